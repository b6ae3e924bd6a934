// libxml2 helpers shared by the CLI's libvirt code (domain_merge, doctor): attribute and child
// element lookup on libvirt's domain, snapshot and pool XML.
#pragma once

#include <libxml/tree.h>

#include <string>

namespace qcommit::cli {

// Attribute value, or "" when n is null or has no such attribute.
inline std::string xml_attr(xmlNodePtr n, const char* name) {
  if (!n) return "";
  xmlChar* v = xmlGetProp(n, reinterpret_cast<const xmlChar*>(name));
  if (!v) return "";
  std::string s(reinterpret_cast<char*>(v));
  xmlFree(v);
  return s;
}

// First child element called `name`, or nullptr.
inline xmlNodePtr xml_child(xmlNodePtr n, const char* name) {
  for (xmlNodePtr c = n ? n->children : nullptr; c; c = c->next)
    if (c->type == XML_ELEMENT_NODE && xmlStrcmp(c->name, reinterpret_cast<const xmlChar*>(name)) == 0) return c;
  return nullptr;
}

}  // namespace qcommit::cli
