// qcommit info: format, features and backing chain of an image.
#include <iostream>
#include <sstream>

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

}  // namespace

int cmd_info(const Args& args) {
  po::options_description opts("options");
  std::string image, output = "human";
  opts.add_options()("image", po::value(&image)->required(), "image file")(
      "output", po::value(&output), "human or json");
  std::vector<std::string> allow_dirs;
  add_backing_policy(opts, allow_dirs);
  po::positional_options_description pos;
  pos.add("image", 1);
  po::variables_map vm;
  if (!parse(args, opts, pos, vm, "qcommit info IMAGE [--output=json]",
             "examples:\n  qcommit info vm.qcow2\n  qcommit info --output=json vm.qcow2\n"))
    return kExitOk;
  const Output out = parse_output(output);
  qcow2::ChainOptions copts;
  copts.allowed_backing_dirs = backing_policy(image, allow_dirs);
  Chain chain = Chain::open(image, copts);
  std::ostringstream js;
  if (out == Output::kJson) js << "{\"filename\": " << json_string(image) << ", \"chain\": [";
  for (size_t i = 0; i < chain.depth(); ++i) {
    auto& L = chain.layer(i);
    const uint64_t disk = L.qcow2 ? L.qcow2->file().allocated_bytes() : L.raw->allocated_bytes();
    if (out == Output::kJson) {
      if (i) js << ", ";
      js << "{\"depth\": " << i << ", \"filename\": " << json_string(L.path)
         << ", \"resolved\": " << json_string(L.real_path) << ", \"format\": \""
         << to_string(L.format) << "\", \"virtual-size\": " << L.virtual_size()
         << ", \"actual-size\": " << disk;
      if (!L.backing_name.empty()) js << ", \"named-as\": " << json_string(L.backing_name);
    } else {
      std::cout << (i == 0 ? "image: " : "\nbacking image (depth " + std::to_string(i) + "): ")
                << L.path << "\n";
      if (L.real_path != L.path) std::cout << "resolved: " << L.real_path << "\n";
      if (!L.backing_name.empty()) std::cout << "named as: " << L.backing_name << "\n";
      std::cout << "file format: " << to_string(L.format) << "\n"
                << "virtual size: " << human_size(L.virtual_size()) << "\n"
                << "disk size: " << human_size(disk) << "\n";
    }
    if (!L.qcow2) {
      if (out == Output::kJson) js << "}";
      continue;
    }
    Image& img = *L.qcow2;
    const auto& h = img.header();
    LayerInfo li = scan_layer(img);
    auto feats = features(h);
    if (out == Output::kJson) {
      js << ", \"cluster-size\": " << img.cluster_size() << ", \"version\": " << h.version
         << ", \"compat\": \"" << (h.version == 2 ? "0.10" : "1.1") << "\""
         << ", \"refcount-bits\": " << img.geometry().refcount_bits()
         << ", \"compression-type\": \""
         << (h.compression_type == qcow2::CompressionType::kZstd ? "zstd" : "zlib") << "\""
         << ", \"extended-l2\": " << json_bool(img.geometry().extended_l2)
         << ", \"internal-snapshots\": " << h.nb_snapshots << ", \"features\": [";
      for (size_t k = 0; k < feats.size(); ++k) js << (k ? ", " : "") << json_string(feats[k]);
      js << "]";
      if (img.backing_name()) js << ", \"backing-filename\": " << json_string(*img.backing_name());
      if (img.backing_format())
        js << ", \"backing-format\": " << json_string(*img.backing_format());
      if (img.data_file_name()) js << ", \"data-file\": " << json_string(*img.data_file_name());
      if (img.bitmaps()) js << ", \"bitmaps\": " << img.bitmaps()->nb_bitmaps;
      js << ", \"allocated-data-bytes\": " << li.data_bytes
         << ", \"allocated-zero-bytes\": " << li.zero_bytes
         << ", \"compressed-bytes\": " << li.compressed_bytes << "}";
    } else {
      std::cout << "cluster size: " << img.cluster_size() << "\n"
                << "version: " << h.version << " (compat " << (h.version == 2 ? "0.10" : "1.1")
                << ")\n"
                << "refcount bits: " << img.geometry().refcount_bits() << "\n";
      if (h.incompatible_features & qcow2::kIncompatCompression || h.version == 3)
        std::cout << "compression type: "
                  << (h.compression_type == qcow2::CompressionType::kZstd ? "zstd" : "zlib")
                  << "\n";
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
      if (li.compressed_bytes)
        std::cout << "compressed: " << human_size(li.compressed_bytes) << "\n";
    }
  }
  if (out == Output::kJson) std::cout << js.str() << "]}\n";
  return kExitOk;
}

}  // namespace qcommit::cli
