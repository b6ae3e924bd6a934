// libvirt's XML (domain, snapshot, pool descriptions) read with libxml2: the one parser and the
// lookups qcommitd and the CLI share. A document that is not well-formed is refused, never
// half-read; no network access, no entity expansion, no messages on stderr.
#pragma once

#include <libxml/tree.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace qcommit::plugin::xml {

struct DocFree {
  void operator()(xmlDocPtr p) const { xmlFreeDoc(p); }
};
using Doc = std::unique_ptr<xmlDoc, DocFree>;

// The parsed document, or null when `text` is not well-formed XML. Blank text nodes are dropped
// (dump() then indents the tree anew).
[[nodiscard]] Doc parse(std::string_view text);

// Attribute value, or "" when n is null or has no such attribute.
[[nodiscard]] std::string attr(xmlNodePtr n, const char* name);

// First child element called `name`, or nullptr.
[[nodiscard]] xmlNodePtr child(xmlNodePtr n, const char* name);

// The text content of n ("" when n is null).
[[nodiscard]] std::string text(xmlNodePtr n);

// The element nodes an XPath expression selects, relative to `context` (the root when null), in
// document order; empty when the expression selects none (or is not valid XPath).
[[nodiscard]] std::vector<xmlNodePtr> select(xmlDocPtr doc, const char* xpath,
                                             xmlNodePtr context = nullptr);

// The first node `xpath` selects, or nullptr.
[[nodiscard]] xmlNodePtr first(xmlDocPtr doc, const char* xpath, xmlNodePtr context = nullptr);

// The document as indented text.
[[nodiscard]] std::string dump(xmlDocPtr doc);

}  // namespace qcommit::plugin::xml
