// SPDX-License-Identifier: GPL-2.0-or-later
// plugin/host/xml.h's builder and the XML qcommitd hands to libvirt: written by libxml2 and read back
// by the same parser, whatever characters the names and paths hold.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "plugin/hypervisor/libvirt_hypervisor.h"
#include "plugin/host/xml.h"

using namespace qcommit::plugin;

namespace {
// Quotes of both kinds, markup characters, an entity reference and a character outside ASCII.
const std::string kHostile = "/images/a'b\"c<d>&amp;e é.qcow2";
}  // namespace

TEST_CASE("plugin.xml.builder_round_trip") {
  const xml::Doc doc = xml::new_document("merge");
  const xmlNodePtr root = xml::root(doc.get());
  xml::set_attr(root, "path", kHostile);
  xml::set_attr(root, "gone", "x");
  xml::unset_attr(root, "gone");
  xml::add_child(root, "top", kHostile);
  xml::add_child(root, "merged", "one");
  xml::add_child(root, "merged", "two");
  xml::add_child(root, "empty");
  const std::string text = xml::dump_element(root);
  CHECK(text.rfind("<merge", 0) == 0);  // one element, no declaration

  const xml::Doc back = xml::parse(text);
  REQUIRE(back);
  const xmlNodePtr r = xml::root(back.get());
  CHECK(xml::name(r) == "merge");
  CHECK(xml::attr(r, "path") == kHostile);
  CHECK(xml::attr(r, "gone").empty());
  CHECK(xml::text(xml::child(r, "top")) == kHostile);
  std::vector<std::string> names, texts;
  for (xmlNodePtr c : xml::children(r)) {
    names.push_back(xml::name(c));
    texts.push_back(xml::text(c));
  }
  CHECK(names == std::vector<std::string>{"top", "merged", "merged", "empty"});
  CHECK(texts == std::vector<std::string>{kHostile, "one", "two", ""});

  xml::remove_children(r, "merged");
  CHECK(xml::children(r).size() == 2);
  CHECK(xml::child(r, "merged") == nullptr);
}

TEST_CASE("plugin.libvirt.disk_only_snapshot_xml") {
  DiskInfo vda, vdb;
  vda.target = "vda";
  vdb.target = "vdb";
  const std::string text = disk_only_snapshot_xml({vda, vdb}, "vda", kHostile);
  const xml::Doc doc = xml::parse(text);
  REQUIRE(doc);
  CHECK(xml::name(xml::root(doc.get())) == "domainsnapshot");
  const auto disks = xml::select(doc.get(), "/domainsnapshot/disks/disk");
  REQUIRE(disks.size() == 2);
  CHECK(xml::attr(disks[0], "name") == "vda");
  CHECK(xml::attr(disks[0], "snapshot") == "external");
  CHECK(xml::attr(disks[0], "type") == "file");
  CHECK(xml::attr(xml::child(disks[0], "driver"), "type") == "qcow2");
  CHECK(xml::attr(xml::child(disks[0], "source"), "file") == kHostile);
  CHECK(xml::attr(disks[1], "name") == "vdb");
  CHECK(xml::attr(disks[1], "snapshot") == "no");
  CHECK(xml::children(disks[1]).empty());
}
