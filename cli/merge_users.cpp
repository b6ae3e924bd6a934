// SPDX-License-Identifier: GPL-2.0-or-later
#include "cli/merge_users.h"

#include <libvirt/libvirt.h>
#include <libvirt/virterror.h>

#include "plugin/hypervisor/libvirt_handles.h"
#include "plugin/host/xml.h"

namespace qcommit::cli {

namespace lv = plugin::lv;
namespace xml = plugin::xml;

namespace {

// The target directories of the active storage pools.
std::vector<std::string> pool_directories(virConnectPtr conn) {
  std::vector<std::string> dirs;
  virStoragePoolPtr* list = nullptr;
  const int n = virConnectListAllStoragePools(conn, &list, VIR_CONNECT_LIST_STORAGE_POOLS_ACTIVE);
  for (lv::Pool& p : lv::take_list<lv::Pool>(list, n)) {
    lv::CString desc(virStoragePoolGetXMLDesc(p.get(), 0));
    if (!desc) continue;
    const xml::Doc doc = xml::parse(desc.get());
    if (!doc) continue;
    const std::string dir = xml::text(xml::first(doc.get(), "/pool/target/path"));
    if (!dir.empty()) dirs.push_back(dir);
  }
  return dirs;
}

// The file or device a <source> element names ("" for a network source).
std::string source_path(xmlNodePtr source) {
  std::string p = xml::attr(source, "file");
  return p.empty() ? xml::attr(source, "dev") : p;
}

// Each disk of the domain whose source, or a <backingStore> source below it, reaches a layer.
void add_domain_users(virDomainPtr dom, const engine::LayerUserQuery& q,
                      std::vector<engine::LayerUser>& out) {
  lv::CString desc(virDomainGetXMLDesc(dom, 0));
  if (!desc) return;
  const xml::Doc doc = xml::parse(desc.get());
  if (!doc) return;
  const char* name = virDomainGetName(dom);
  for (xmlNodePtr disk : xml::select(doc.get(), "/domain/devices/disk")) {
    const std::string target = xml::attr(xml::child(disk, "target"), "dev");
    for (xmlNodePtr source : xml::select(doc.get(), ".//source", disk)) {
      const std::string path = source_path(source);
      if (path.empty()) continue;
      if (const auto layer = engine::layer_reached_from(path, q)) {
        out.push_back({*layer, "domain " + std::string(name ? name : "?") + " (disk " + target +
                                   ", through " + path + ")"});
        break;
      }
    }
  }
}

std::vector<engine::LayerUser> domain_users(virConnectPtr conn, const engine::LayerUserQuery& q,
                                            const std::string& merged_domain) {
  std::vector<engine::LayerUser> out;
  virDomainPtr* list = nullptr;
  const int n = virConnectListAllDomains(conn, &list, 0);  // running and shut off
  for (lv::Domain& d : lv::take_list<lv::Domain>(list, n)) {
    const char* name = virDomainGetName(d.get());
    if (!merged_domain.empty() && name && merged_domain == name) continue;
    add_domain_users(d.get(), q, out);
  }
  return out;
}

// The directories of the files every domain's disks and their backing chains name.
std::vector<std::string> domain_disk_directories(virConnectPtr conn) {
  std::vector<std::string> dirs;
  virDomainPtr* list = nullptr;
  const int n = virConnectListAllDomains(conn, &list, 0);  // running and shut off
  for (lv::Domain& d : lv::take_list<lv::Domain>(list, n)) {
    lv::CString desc(virDomainGetXMLDesc(d.get(), 0));
    if (!desc) continue;
    const xml::Doc doc = xml::parse(desc.get());
    if (!doc) continue;
    for (xmlNodePtr source : xml::select(doc.get(), "/domain/devices/disk//source")) {
      const std::string path = source_path(source);
      const size_t slash = path.rfind('/');
      // Files only: a device under /dev does not make /dev a directory of images.
      if (path.empty() || slash == std::string::npos || path.rfind("/dev/", 0) == 0) continue;
      dirs.push_back(slash == 0 ? "/" : path.substr(0, slash));
    }
  }
  return dirs;
}

}  // namespace

std::vector<std::string> libvirt_image_directories(const std::string& uri) {
  virSetErrorFunc(nullptr, [](void*, virErrorPtr) {});  // no libvirtd here: not printed
  lv::Conn conn(virConnectOpenReadOnly(uri.c_str()));
  if (!conn) return {};
  std::vector<std::string> dirs = pool_directories(conn.get());
  for (std::string& d : domain_disk_directories(conn.get())) dirs.push_back(std::move(d));
  return dirs;
}

engine::FindLayerUsers libvirt_layer_users(std::string uri, std::string merged_domain) {
  return [uri = std::move(uri), merged_domain = std::move(merged_domain)](
             const engine::LayerUserQuery& q) -> std::vector<engine::LayerUser> {
    // Expected failures (no libvirtd here) are not printed by libvirt's default handler.
    virSetErrorFunc(nullptr, [](void*, virErrorPtr) {});
    lv::Conn conn(virConnectOpenReadOnly(uri.c_str()));
    if (!conn) return {};
    std::vector<engine::LayerUser> out = engine::image_users_in(pool_directories(conn.get()), q);
    for (engine::LayerUser& u : domain_users(conn.get(), q, merged_domain)) out.push_back(std::move(u));
    return out;
  };
}

}  // namespace qcommit::cli
