// SPDX-License-Identifier: GPL-2.0-or-later
#include "qcow2/chain.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <string_view>

#include "qcow2/error.h"

namespace qcommit::qcow2 {

const char* to_string(Format f) { return f == Format::kQcow2 ? "qcow2" : "raw"; }

uint64_t Layer::virtual_size() const { return qcow2 ? qcow2->virtual_size() : raw->size(); }

Format probe_format(BlockDevice& dev) {
  if (dev.size() >= 4) {
    uint8_t m[4];
    dev.read(0, m);
    if (boost::endian::load_big_u32(m) == kMagic) return Format::kQcow2;
  }
  return Format::kRaw;
}

std::string resolve_backing(const std::string& image_path, const std::string& name) {
  if (name.rfind("json:", 0) == 0)
    throw UnsupportedError(image_path, "backing file name '" + name.substr(0, 64) +
                                           "' is a json: specification; only plain file names are followed");
  // QEMU takes a ':' before any '/' as the end of a protocol name ("nbd:", "http:", ...).
  std::string plain = name;
  if (const auto stop = name.find_first_of(":/"); stop != std::string::npos && name[stop] == ':') {
    const std::string proto = name.substr(0, stop);
    if (proto != "file")
      throw UnsupportedError(image_path, "backing file name '" + name.substr(0, 64) +
                                             "' uses protocol '" + proto.substr(0, 64) +
                                             "'; only local files are followed");
    // The file protocol opens what follows as given: not joined to the image's directory.
    plain = name.substr(stop + 1);
    if (plain.empty()) throw Error(image_path, "empty backing file name");
    return plain;
  }
  if (plain.empty()) throw Error(image_path, "empty backing file name");
  if (plain.front() == '/') return plain;
  const auto slash = image_path.rfind('/');
  return (slash == std::string::npos ? std::string() : image_path.substr(0, slash + 1)) + plain;
}

bool inside_dirs(const std::string& real_path, const std::vector<std::string>& dirs) {
  for (const auto& dir : dirs) {
    std::string d;
    try {
      const PathHandle h = PathHandle::lookup(dir);
      if (std::string_view(h.kind()) != "a directory") continue;
      d = h.real_path();
    } catch (const Error&) {
      continue;  // a directory that does not exist contains nothing
    }
    if (d == "/") return true;
    if (real_path.size() > d.size() && real_path.compare(0, d.size(), d) == 0 &&
        real_path[d.size()] == '/')
      return true;
  }
  return false;
}

namespace {

Format parse_format(const std::string& image, const std::string& fmt) {
  if (fmt == "qcow2") return Format::kQcow2;
  if (fmt == "raw" || fmt == "file" || fmt == "host_device") return Format::kRaw;
  throw UnsupportedError(image, "backing format '" + fmt + "' is not supported (only qcow2 and raw)");
}

// Looks up the file `image` names as `what` ("backing file", "external data file") at `path`
// (resolve_backing's result) without opening it, then applies the policy before anything opens
// it for I/O: it must resolve inside the allowed trees and be a regular file or block device.
// A file that does not exist is looked up again as long as options.await_missing says so.
PathHandle look_up_named(const std::string& image, const std::string& what, const std::string& name,
                         const std::string& path, const ChainOptions& options) {
  const std::vector<std::string>& allowed = options.allowed_backing_dirs;
  PathHandle h = [&] {
    for (;;) {
      try {
        return PathHandle::lookup(path);
      } catch (const IoError& e) {
        if (e.error_number() == ENOENT && options.await_missing && options.await_missing(path))
          continue;
        throw Error(image, "cannot open " + what + " '" + name + "': " + e.problem());
      }
    }
  }();
  if (!allowed.empty() && !inside_dirs(h.real_path(), allowed)) {
    std::string dirs;
    for (const auto& d : allowed) dirs += (dirs.empty() ? "" : ", ") + d;
    // The exact option that would let it be followed: its directory.
    const std::string& real = h.real_path();
    const size_t slash = real.rfind('/');
    const std::string dir = slash == 0 || slash == std::string::npos ? "/" : real.substr(0, slash);
    throw Error(image, what + " '" + name + "' resolves to " + real +
                           ", outside the allowed directories (" + dirs +
                           "); to follow it, add --allow-backing-dir " + dir);
  }
  if (!h.regular_or_block())
    throw Error(image, what + " '" + name + "' (" + h.real_path() + ") is " + h.kind() +
                           ", not a regular file or block device; refusing to open it");
  return h;
}

std::unique_ptr<FileDevice> open_named(const std::string& image, const std::string& what,
                                       const std::string& name, const PathHandle& h,
                                       bool writable) {
  try {
    return FileDevice::open(h, {.writable = writable});
  } catch (const IoError& e) {
    throw Error(image, "cannot open " + what + " '" + name + "': " + e.problem());
  }
}

}  // namespace

Chain Chain::open(const std::string& path, ChainOptions options, std::optional<Format> format) {
  Chain chain;
  std::set<FileId> seen;
  std::string current = path;
  std::string named_as;
  std::string named_by;
  std::optional<Format> fmt = format;
  for (size_t depth = 0;; ++depth) {
    if (depth >= options.max_depth)
      throw Error(path, "backing chain deeper than " + std::to_string(options.max_depth) + " layers");
    const bool writable = (depth == 0 && options.writable_top) ||
                          (options.writable_depth && *options.writable_depth == depth);
    struct stat missing_st {};
    if (depth > 0 && options.stop_at_missing_backing && !options.await_missing &&
        ::lstat(current.c_str(), &missing_st) != 0 && errno == ENOENT) {
      chain.missing_ = MissingBacking{named_by, named_as, current};
      break;
    }
    // Nothing is opened for I/O before the policy and the loop check ran on the lookup.
    const PathHandle handle =
        depth == 0 ? PathHandle::lookup(current)
                   : look_up_named(named_by, "backing file", named_as, current, options);
    if (!seen.insert(handle.id()).second)
      throw Error(named_by.empty() ? path : named_by, "backing chain loop: '" + current + "' (" +
                                                          handle.real_path() +
                                                          ") is already in the chain");
    std::unique_ptr<FileDevice> dev =
        depth == 0 ? FileDevice::open(handle, {.writable = writable})
                   : open_named(named_by, "backing file", named_as, handle, writable);
    auto layer = std::make_unique<Layer>();
    layer->path = current;
    layer->real_path = handle.real_path();
    layer->id = handle.id();
    layer->backing_name = named_as;
    layer->format = fmt ? *fmt : probe_format(*dev);
    if (layer->format == Format::kRaw) {
      layer->raw = std::move(dev);
      chain.layers_.push_back(std::move(layer));
      break;
    }
    layer->qcow2 = Image::open(std::move(dev), {.writable = writable, .cache_bytes = options.cache_bytes});
    Image& img = *layer->qcow2;
    if (img.has_data_file()) {
      if (!img.data_file_name())
        throw Error(current, "image uses an external data file but does not name it");
      const std::string& dname = *img.data_file_name();
      const PathHandle dh = look_up_named(current, "external data file", dname,
                                          resolve_backing(current, dname), options);
      img.attach_data_file(open_named(current, "external data file", dname, dh, writable));
    }
    std::optional<std::string> next = img.backing_name();
    std::optional<std::string> next_fmt = img.backing_format();
    chain.layers_.push_back(std::move(layer));
    if (!next) break;
    named_by = current;
    named_as = *next;
    current = resolve_backing(named_by, named_as);
    fmt = next_fmt ? std::optional<Format>(parse_format(named_by, *next_fmt)) : std::nullopt;
  }
  return chain;
}

Chain::LayerStatus Chain::layer_status(size_t i, uint64_t offset, uint64_t len) {
  Layer& L = *layers_[i];
  LayerStatus st;
  const uint64_t size = L.virtual_size();
  len = std::min(len, size - offset);
  if (L.format == Format::kRaw) {
    AllocationRun a = L.raw->allocation(offset, len);
    st.length = a.length;
    st.data = a.data;
    st.zero = !a.data;
    st.allocated = true;
    st.offset = offset;
    return st;
  }
  Image& img = *L.qcow2;
  Run run = img.lookup(offset, len);
  st.length = run.length;
  switch (run.type) {
    case SubclusterType::kNormal: st.data = true; st.offset = run.host_offset; break;
    case SubclusterType::kZeroAlloc: st.zero = true; st.offset = run.host_offset; break;
    case SubclusterType::kUnallocatedAlloc: st.offset = run.host_offset; break;
    case SubclusterType::kZeroPlain: st.zero = true; break;
    case SubclusterType::kCompressed: st.data = true; st.compressed = true; break;
    case SubclusterType::kUnallocatedPlain: break;
  }
  if (st.data || st.zero) {
    st.allocated = true;
  } else if (i + 1 == layers_.size() || offset >= layers_[i + 1]->virtual_size()) {
    st.zero = true;  // no backing, or past the backing file's end: reads as zeros
  } else {
    // Unallocated here, so the backing file provides it -- up to the backing file's end only:
    // what lies beyond reads as zeros even where the backing file's own backing is larger.
    st.length = std::min(st.length, layers_[i + 1]->virtual_size() - offset);
  }
  // preallocation=metadata: ask the file whether the data cluster is a hole (QEMU's RECURSE).
  if (st.data && !st.zero && st.offset && img.metadata_preallocated()) {
    BlockDevice& f = img.data_device();
    const uint64_t host = *st.offset;
    const uint64_t fsize = f.size();
    if (host >= fsize) {
      st.zero = true;
    } else {
      AllocationRun a = f.allocation(host, std::min(st.length, fsize - host));
      const bool eof = host + a.length >= fsize;
      if (eof && !a.data) {
        st.zero = true;
      } else {
        st.length = a.length;
        st.zero = !a.data;
      }
    }
  }
  return st;
}

MapEntry Chain::status(uint64_t offset, uint64_t len, size_t from_depth,
                        std::optional<size_t> stop_depth) {
  uint64_t n = len;
  size_t i = from_depth;
  LayerStatus st;
  for (;; ++i) {
    if (stop_depth && i == *stop_depth) {
      MapEntry none;
      none.start = offset;
      none.length = n;
      none.depth = uint32_t(i);
      return none;
    }
    st = layer_status(i, offset, n);
    n = st.length;
    if (st.data || st.zero || i + 1 == layers_.size()) break;
  }
  MapEntry e;
  e.start = offset;
  e.length = n;
  e.depth = uint32_t(i);
  e.present = st.allocated;
  e.zero = st.zero;
  e.data = st.data;
  e.offset = st.offset;
  e.compressed = st.compressed;
  return e;
}

bool mergeable(const MapEntry& a, const MapEntry& b) {
  if (a.length == 0) return false;
  if (a.depth != b.depth || a.data != b.data || a.zero != b.zero || a.present != b.present)
    return false;
  if (a.offset.has_value() != b.offset.has_value()) return false;
  if (a.offset && *a.offset + a.length != *b.offset) return false;
  return a.start + a.length == b.start;
}

std::vector<MapEntry> Chain::map(uint64_t offset, std::optional<uint64_t> len) {
  const uint64_t size = virtual_size();
  const uint64_t end = len ? std::min(size, offset + *len) : size;
  std::vector<MapEntry> out;
  while (offset < end) {
    MapEntry e = status(offset, end - offset);
    if (e.length == 0) throw Error(top().name(), "block status made no progress at " + hex(offset));
    offset += e.length;
    if (!out.empty() && mergeable(out.back(), e)) {
      out.back().length += e.length;
      out.back().compressed = out.back().compressed || e.compressed;
    } else {
      out.push_back(e);
    }
  }
  return out;
}

void Chain::read(uint64_t offset, std::span<uint8_t> out, size_t from_depth) {
  if (from_depth >= layers_.size()) {
    std::fill(out.begin(), out.end(), uint8_t{0});
    return;
  }
  Layer& L = *layers_[from_depth];
  const uint64_t size = L.virtual_size();
  size_t pos = 0;
  while (pos < out.size()) {
    const uint64_t off = offset + pos;
    auto rest = out.subspan(pos);
    if (off >= size) {
      std::fill(rest.begin(), rest.end(), uint8_t{0});
      return;
    }
    const uint64_t want = std::min<uint64_t>(rest.size(), size - off);
    if (L.format == Format::kRaw) {
      L.raw->read(off, rest.first(want));
      pos += want;
      continue;
    }
    Run run = L.qcow2->lookup(off, want);
    auto piece = rest.first(run.length);
    switch (run.type) {
      case SubclusterType::kNormal:
      case SubclusterType::kCompressed:
        L.qcow2->read_run(run, off, piece);
        break;
      case SubclusterType::kZeroPlain:
      case SubclusterType::kZeroAlloc:
        std::fill(piece.begin(), piece.end(), uint8_t{0});
        break;
      case SubclusterType::kUnallocatedPlain:
      case SubclusterType::kUnallocatedAlloc:
        read(off, piece, from_depth + 1);
        break;
    }
    pos += run.length;
  }
}

}  // namespace qcommit::qcow2
