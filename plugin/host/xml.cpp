// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/host/xml.h"

#include <libxml/parser.h>
#include <libxml/xpath.h>

#include <new>

namespace qcommit::plugin::xml {

namespace {
struct XPathContextFree {
  void operator()(xmlXPathContextPtr p) const { xmlXPathFreeContext(p); }
};
struct XPathObjectFree {
  void operator()(xmlXPathObjectPtr p) const { xmlXPathFreeObject(p); }
};
struct BufferFree {
  void operator()(xmlBufferPtr p) const { xmlBufferFree(p); }
};
const xmlChar* u(const char* s) {
  return reinterpret_cast<const xmlChar*>(s);
}
constexpr int kParseOptions = XML_PARSE_NONET | XML_PARSE_NOBLANKS | XML_PARSE_NOERROR |
                              XML_PARSE_NOWARNING;
}  // namespace

Doc parse(std::string_view text) {
  return Doc(xmlReadMemory(text.data(), int(text.size()), "libvirt.xml", nullptr, kParseOptions));
}

std::string attr(xmlNodePtr n, const char* name) {
  if (!n) return "";
  xmlChar* v = xmlGetProp(n, reinterpret_cast<const xmlChar*>(name));
  if (!v) return "";
  std::string s(reinterpret_cast<char*>(v));
  xmlFree(v);
  return s;
}

xmlNodePtr child(xmlNodePtr n, const char* name) {
  for (xmlNodePtr c = n ? n->children : nullptr; c; c = c->next)
    if (c->type == XML_ELEMENT_NODE && xmlStrcmp(c->name, reinterpret_cast<const xmlChar*>(name)) == 0)
      return c;
  return nullptr;
}

std::string text(xmlNodePtr n) {
  if (!n) return "";
  xmlChar* t = xmlNodeGetContent(n);
  if (!t) return "";
  std::string s(reinterpret_cast<char*>(t));
  xmlFree(t);
  return s;
}

std::vector<xmlNodePtr> select(xmlDocPtr doc, const char* xpath, xmlNodePtr context) {
  std::vector<xmlNodePtr> out;
  if (!doc) return out;
  std::unique_ptr<xmlXPathContext, XPathContextFree> ctx(xmlXPathNewContext(doc));
  if (!ctx) return out;
  ctx->node = context ? context : xmlDocGetRootElement(doc);
  std::unique_ptr<xmlXPathObject, XPathObjectFree> res(
      xmlXPathEvalExpression(reinterpret_cast<const xmlChar*>(xpath), ctx.get()));
  if (!res || res->type != XPATH_NODESET || !res->nodesetval) return out;
  for (int i = 0; i < res->nodesetval->nodeNr; ++i) out.push_back(res->nodesetval->nodeTab[i]);
  return out;
}

xmlNodePtr first(xmlDocPtr doc, const char* xpath, xmlNodePtr context) {
  const auto nodes = select(doc, xpath, context);
  return nodes.empty() ? nullptr : nodes.front();
}

std::string dump(xmlDocPtr doc) {
  xmlChar* out = nullptr;
  int len = 0;
  xmlDocDumpFormatMemory(doc, &out, &len, 1);
  std::string s(out ? reinterpret_cast<char*>(out) : "", out ? size_t(len) : 0);
  xmlFree(out);
  return s;
}

std::vector<xmlNodePtr> children(xmlNodePtr n) {
  std::vector<xmlNodePtr> out;
  for (xmlNodePtr c = n ? n->children : nullptr; c; c = c->next)
    if (c->type == XML_ELEMENT_NODE) out.push_back(c);
  return out;
}

std::string name(xmlNodePtr n) {
  return n && n->name ? reinterpret_cast<const char*>(n->name) : "";
}

xmlNodePtr root(xmlDocPtr doc) {
  return doc ? xmlDocGetRootElement(doc) : nullptr;
}

Doc new_document(const char* root_name) {
  Doc d(xmlNewDoc(u("1.0")));
  if (!d) throw std::bad_alloc();
  xmlNodePtr r = xmlNewDocNode(d.get(), nullptr, u(root_name), nullptr);
  if (!r) throw std::bad_alloc();
  xmlDocSetRootElement(d.get(), r);
  return d;
}

xmlNodePtr add_child(xmlNodePtr parent, const char* name, std::string_view text) {
  xmlNodePtr c = xmlNewChild(parent, nullptr, u(name), nullptr);
  if (!c) throw std::bad_alloc();
  // A text node holds the characters as they are; libxml2 escapes them when it writes the tree.
  if (!text.empty())
    xmlNodeAddContentLen(c, reinterpret_cast<const xmlChar*>(text.data()), int(text.size()));
  return c;
}

void set_attr(xmlNodePtr n, const char* name, std::string_view value) {
  const std::string v(value);  // libxml2 wants it terminated
  if (!xmlSetProp(n, u(name), u(v.c_str()))) throw std::bad_alloc();
}

void unset_attr(xmlNodePtr n, const char* name) {
  xmlUnsetProp(n, u(name));
}

void remove_children(xmlNodePtr n, const char* name) {
  while (xmlNodePtr c = child(n, name)) {
    xmlUnlinkNode(c);
    xmlFreeNode(c);
  }
}

std::string dump_element(xmlNodePtr n) {
  std::unique_ptr<xmlBuffer, BufferFree> buf(xmlBufferCreate());
  if (!buf) throw std::bad_alloc();
  if (xmlNodeDump(buf.get(), n->doc, n, 0, 0) < 0) throw std::bad_alloc();
  return std::string(reinterpret_cast<const char*>(xmlBufferContent(buf.get())),
                     size_t(xmlBufferLength(buf.get())));
}

}  // namespace qcommit::plugin::xml
