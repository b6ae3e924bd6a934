// SPDX-License-Identifier: GPL-2.0-or-later
// RAII for libvirt's handles and for the strings and arrays it hands over (glue, no policy).
// Header-only: used by qcommitd's adapter (plugin/libvirt_hypervisor.cpp) and by the CLI's
// offline-domain merge and doctor.
#pragma once

#include <libvirt/libvirt.h>

#include <cstdlib>
#include <memory>
#include <vector>

namespace qcommit::plugin::lv {

template <auto Release>
struct Releaser {
  template <class T>
  void operator()(T* p) const {
    if (p) (void)Release(p);
  }
};
struct FreeC {
  void operator()(void* p) const { std::free(p); }
};

using Conn = std::unique_ptr<virConnect, Releaser<virConnectClose>>;
using Domain = std::unique_ptr<virDomain, Releaser<virDomainFree>>;
using Snapshot = std::unique_ptr<virDomainSnapshot, Releaser<virDomainSnapshotFree>>;
using Pool = std::unique_ptr<virStoragePool, Releaser<virStoragePoolFree>>;
using Vol = std::unique_ptr<virStorageVol, Releaser<virStorageVolFree>>;
using CString = std::unique_ptr<char, FreeC>;  // strings libvirt returns (XML, metadata)

// Owns the array a virConnectListAll*() call filled (`n` < 0: the call failed, nothing to own).
template <class Handle>
[[nodiscard]] std::vector<Handle> take_list(typename Handle::pointer* list, int n) {
  std::vector<Handle> out;
  for (int i = 0; i < n; ++i) out.emplace_back(list[i]);
  std::free(list);
  return out;
}

}  // namespace qcommit::plugin::lv
