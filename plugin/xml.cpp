#include "plugin/xml.h"

#include <libxml/parser.h>
#include <libxml/xpath.h>

namespace qcommit::plugin::xml {

namespace {
struct XPathContextFree {
  void operator()(xmlXPathContextPtr p) const { xmlXPathFreeContext(p); }
};
struct XPathObjectFree {
  void operator()(xmlXPathObjectPtr p) const { xmlXPathFreeObject(p); }
};
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

}  // namespace qcommit::plugin::xml
