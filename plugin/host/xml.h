// SPDX-License-Identifier: GPL-2.0-or-later
// libvirt's XML (domain, snapshot, pool descriptions) read and written with libxml2: the one
// parser, the lookups and the builder qcommitd and the CLI share. A document that is not
// well-formed is refused, never half-read; no network access, no entity expansion, no messages on
// stderr. What is built is escaped by libxml2 when it is written: no XML is made of strings.
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

// The child elements of n in document order (none when n is null).
[[nodiscard]] std::vector<xmlNodePtr> children(xmlNodePtr n);

// The element's name ("" when n is null).
[[nodiscard]] std::string name(xmlNodePtr n);

// The root element, or nullptr.
[[nodiscard]] xmlNodePtr root(xmlDocPtr doc);

// The document as indented text.
[[nodiscard]] std::string dump(xmlDocPtr doc);

// --- building --------------------------------------------------------------------------------

// A new document of one element called `root_name`.
[[nodiscard]] Doc new_document(const char* root_name);

// Appends an element called `name` to `parent`, holding `text` when that is not empty; returns it.
xmlNodePtr add_child(xmlNodePtr parent, const char* name, std::string_view text = {});

// Sets attribute `name` of n to `value`, replacing a value it had.
void set_attr(xmlNodePtr n, const char* name, std::string_view value);

// Removes attribute `name` of n, if it has one.
void unset_attr(xmlNodePtr n, const char* name);

// Removes (and frees) every child element of n called `name`.
void remove_children(xmlNodePtr n, const char* name);

// The element n and what it holds as text, without an XML declaration: what libvirt takes where
// it wants one element (snapshot definitions, domain metadata).
[[nodiscard]] std::string dump_element(xmlNodePtr n);

}  // namespace qcommit::plugin::xml
