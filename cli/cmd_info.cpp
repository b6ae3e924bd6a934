// SPDX-License-Identifier: GPL-2.0-or-later
// qcommit info: format, features and backing chain of an image.
#include <iostream>

#include "cli/json.h"
#include "cli/options.h"
#include "cli/units.h"
#include "qcow2/chain.h"
#include "qcow2/error.h"

namespace qcommit::cli {

namespace {

using qcow2::Chain;
using qcow2::Format;
using qcow2::Image;
using qcow2::SubclusterType;

struct LayerInfo {
  uint64_t data_bytes = 0;        // normal + compressed
  uint64_t zero_bytes = 0;        // zero clusters (plain and allocated)
  uint64_t compressed_bytes = 0;  // guest bytes in compressed clusters
};

// Guest bytes this layer provides itself; cost proportional to its allocated metadata.
LayerInfo scan_layer(Image& img) {
  LayerInfo li;
  const uint64_t size = img.virtual_size();
  uint64_t off = 0;
  while (off < size) {
    qcow2::Run r = img.lookup(off, size - off);
    switch (r.type) {
      case SubclusterType::kNormal:
        li.data_bytes += r.length;
        break;
      case SubclusterType::kCompressed:
        li.data_bytes += r.length;
        li.compressed_bytes += r.length;
        break;
      case SubclusterType::kZeroPlain:
      case SubclusterType::kZeroAlloc:
        li.zero_bytes += r.length;
        break;
      default:
        break;
    }
    off += r.length;
  }
  return li;
}

std::vector<std::string> features(const qcow2::Header& h) {
  std::vector<std::string> f;
  if (h.incompatible_features & qcow2::kIncompatDirty) f.push_back("dirty");
  if (h.incompatible_features & qcow2::kIncompatCorrupt) f.push_back("corrupt");
  if (h.incompatible_features & qcow2::kIncompatDataFile) f.push_back("data-file");
  if (h.incompatible_features & qcow2::kIncompatCompression) f.push_back("compression-type");
  if (h.incompatible_features & qcow2::kIncompatExtendedL2) f.push_back("extended-l2");
  if (h.compatible_features & qcow2::kCompatLazyRefcounts) f.push_back("lazy-refcounts");
  if (h.autoclear_features & qcow2::kAutoclearBitmaps) f.push_back("bitmaps");
  if (h.autoclear_features & qcow2::kAutoclearDataFileRaw) f.push_back("data-file-raw");
  return f;
}

const char* compat_of(const qcow2::Header& h) {
  return h.version == 2 ? "0.10" : "1.1";
}

const char* compression_of(const qcow2::Header& h) {
  return h.compression_type == qcow2::CompressionType::kZstd ? "zstd" : "zlib";
}

uint64_t disk_bytes(const qcow2::Layer& L) {
  return L.qcow2 ? L.qcow2->file().allocated_bytes() : L.raw->allocated_bytes();
}

// What a qcow2 layer adds to its entry in the JSON chain.
void add_qcow2_json(json::Ordered& j, Image& img) {
  const auto& h = img.header();
  const LayerInfo li = scan_layer(img);
  j["cluster-size"] = img.cluster_size();
  j["version"] = h.version;
  j["compat"] = compat_of(h);
  j["refcount-bits"] = img.geometry().refcount_bits();
  j["compression-type"] = compression_of(h);
  j["extended-l2"] = img.geometry().extended_l2;
  j["internal-snapshots"] = h.nb_snapshots;
  j["features"] = features(h);
  if (img.backing_name()) j["backing-filename"] = *img.backing_name();
  if (img.backing_format()) {
    j["backing-format"] = *img.backing_format();
    j["backing-filename-format"] = *img.backing_format();  // qemu-img info's name for it
  }
  j["dirty-flag"] = (h.incompatible_features & qcow2::kIncompatDirty) != 0;
  if (img.data_file_name()) j["data-file"] = *img.data_file_name();
  if (img.bitmaps()) j["bitmaps"] = img.bitmaps()->nb_bitmaps;
  j["allocated-data-bytes"] = li.data_bytes;
  j["allocated-zero-bytes"] = li.zero_bytes;
  j["compressed-bytes"] = li.compressed_bytes;
}

json::Ordered layer_json(Chain& chain, size_t i) {
  auto& L = chain.layer(i);
  json::Ordered j{{"depth", i},
                  {"filename", L.path},
                  {"resolved", L.real_path},
                  {"format", to_string(L.format)},
                  {"virtual-size", L.virtual_size()},
                  {"actual-size", disk_bytes(L)}};
  if (!L.backing_name.empty()) j["named-as"] = L.backing_name;
  if (L.qcow2) add_qcow2_json(j, *L.qcow2);
  // As qemu-img info: the backing file's name joined to this image's directory as given.
  if (i + 1 < chain.depth()) j["full-backing-filename"] = chain.layer(i + 1).path;
  return j;
}

void print_qcow2_layer(Image& img) {
  const auto& h = img.header();
  const LayerInfo li = scan_layer(img);
  const auto feats = features(h);
  std::cout << "cluster size: " << img.cluster_size() << "\n"
            << "version: " << h.version << " (compat " << compat_of(h) << ")\n"
            << "refcount bits: " << img.geometry().refcount_bits() << "\n";
  if (h.incompatible_features & qcow2::kIncompatCompression || h.version == 3)
    std::cout << "compression type: " << compression_of(h) << "\n";
  std::cout << "features:";
  for (auto& f : feats) std::cout << " " << f;
  std::cout << (feats.empty() ? " none\n" : "\n");
  if (img.backing_name())
    std::cout << "backing file: " << *img.backing_name()
              << " (format: " << img.backing_format().value_or("probed") << ")\n";
  if (img.data_file_name()) std::cout << "data file: " << *img.data_file_name() << "\n";
  if (h.nb_snapshots) std::cout << "internal snapshots: " << h.nb_snapshots << "\n";
  if (img.bitmaps()) std::cout << "bitmaps: " << img.bitmaps()->nb_bitmaps << "\n";
  std::cout << "allocated data: " << human_size(li.data_bytes) << "\n"
            << "allocated zeros: " << human_size(li.zero_bytes) << "\n";
  if (li.compressed_bytes) std::cout << "compressed: " << human_size(li.compressed_bytes) << "\n";
}

void print_layer(Chain& chain, size_t i) {
  auto& L = chain.layer(i);
  std::cout << (i == 0 ? "image: " : "\nbacking image (depth " + std::to_string(i) + "): ")
            << L.path << "\n";
  if (L.real_path != L.path) std::cout << "resolved: " << L.real_path << "\n";
  if (!L.backing_name.empty()) std::cout << "named as: " << L.backing_name << "\n";
  std::cout << "file format: " << to_string(L.format) << "\n"
            << "virtual size: " << human_size(L.virtual_size()) << "\n"
            << "disk size: " << human_size(disk_bytes(L)) << "\n";
  if (L.qcow2) print_qcow2_layer(*L.qcow2);
}

// The chain's end when its last backing file does not exist: where it was looked for, how it
// is named; {"missing": true} in JSON.
json::Ordered missing_json(const qcow2::MissingBacking& m, size_t depth) {
  return json::Ordered{{"depth", depth}, {"filename", m.path}, {"named-as", m.name}, {"missing", true}};
}

void print_missing(const qcow2::MissingBacking& m, size_t depth) {
  std::cout << "\nbacking image (depth " << depth << "): " << m.path << "\n"
            << "named as: " << m.name << "\n"
            << "missing: the file does not exist\n";
}

}  // namespace

int cmd_info(const Args& args) {
  const auto cmd = parse_chain_command(
      args,
      {.output_help = "human or json",
       .synopsis = "qcommit info IMAGE [--output=json]",
       .examples = "examples:\n  qcommit info vm.qcow2\n  qcommit info --output=json vm.qcow2\n"});
  if (!cmd) return kExitOk;
  const std::string& image = cmd->image;
  qcow2::ChainOptions options = cmd->chain;
  options.stop_at_missing_backing = true;  // shown down to the missing file, then an error
  Chain chain = Chain::open(image, options);
  const auto& missing = chain.missing_backing();
  if (cmd->output == Output::kJson) {
    json::Ordered layers = json::Ordered::array();
    for (size_t i = 0; i < chain.depth(); ++i) layers.push_back(layer_json(chain, i));
    if (missing) layers.push_back(missing_json(*missing, chain.depth()));
    print_json(json::Ordered{{"filename", image}, {"chain", layers}});
  } else {
    for (size_t i = 0; i < chain.depth(); ++i) print_layer(chain, i);
    if (missing) print_missing(*missing, chain.depth());
  }
  if (!missing) return kExitOk;
  std::cout.flush();
  // Exit 1, as qemu-img info --backing-chain does for the same chain.
  throw qcow2::Error(missing->named_by, "backing file '" + missing->name + "' (" + missing->path +
                                            ") does not exist");
}

}  // namespace qcommit::cli
