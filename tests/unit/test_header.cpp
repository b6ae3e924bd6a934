// SPDX-License-Identifier: GPL-2.0-or-later
// Header parsing: v2, v3, long headers, extensions (known and unknown), feature name table; a
// header rewrite lays the header out as the specification does.
#include <doctest/doctest.h>

#include "qcow2/writer.h"
#include "tests/unit/helpers.h"

using namespace qcommit;
using namespace qcommit::test;
using qcow2::CompressionType;

TEST_CASE("qcow2.header.v2") {
  ImageSpec s;
  s.version = 2;
  s.cluster_bits = 12;
  s.size = 10ull << 20;
  s.backing = "base.img";
  ImageBuilder b(s);
  auto img = open_image(b);
  const auto& h = img->header();
  CHECK(h.version == 2);
  CHECK(h.header_length == 72);
  CHECK(h.refcount_order == 4);  // v2: always 16-bit refcounts
  CHECK(h.incompatible_features == 0);
  CHECK(h.compatible_features == 0);
  CHECK(h.autoclear_features == 0);
  CHECK(h.compression_type == CompressionType::kZlib);
  CHECK(img->virtual_size() == 10ull << 20);
  CHECK(img->cluster_size() == 4096);
  CHECK(h.l1_size == b.l1_size());
  CHECK(h.l1_table_offset == b.l1_offset());
  CHECK(h.refcount_table_offset == b.reftable_offset());
  CHECK(img->backing_name() == std::optional<std::string>("base.img"));
  CHECK_FALSE(img->backing_format());
  CHECK(img->extensions().empty());
  CHECK_FALSE(img->dirty());
}

TEST_CASE("qcow2.header.v2_ignores_v3_fields") {
  // Bytes 72..103 of a v2 image belong to extensions/backing name, never to v3 fields.
  ImageSpec s;
  s.version = 2;
  s.extensions = {{0x12345678, {1, 2, 3}}};
  ImageBuilder b(s);
  auto img = open_image(b);
  CHECK(img->header().incompatible_features == 0);
  REQUIRE(img->extensions().size() == 1);
  CHECK(img->extensions()[0].type == 0x12345678);
}

TEST_CASE("qcow2.header.v3") {
  ImageSpec s;
  s.cluster_bits = 16;
  s.size = (3ull << 30) + 512;
  s.refcount_order = 5;
  s.compatible = 1;    // lazy refcounts
  s.autoclear = 2;     // data-file-raw alone (no data file: QEMU clears it, we just report it)
  s.incompatible = 1;  // dirty
  s.compression_type = 1;
  ImageBuilder b(s);
  auto img = open_image(b);
  const auto& h = img->header();
  CHECK(h.version == 3);
  CHECK(h.header_length == 112);
  CHECK(h.refcount_order == 5);
  CHECK(img->geometry().refcount_bits() == 32);
  CHECK(h.compression_type == CompressionType::kZstd);
  CHECK(h.compatible_features == 1);
  CHECK(h.autoclear_features == 2);
  CHECK(img->dirty());
  CHECK_FALSE(img->corrupt());
  CHECK(img->virtual_size() == (3ull << 30) + 512);
  CHECK(h.l1_size == 7);  // 512 MiB per L2 table
  CHECK(img->l1_table().size() == 7);
  CHECK_FALSE(img->backing_name());
}

TEST_CASE("qcow2.header.v3_104_bytes_means_zlib") {
  ImageSpec s;
  ImageBuilder b(s);
  b.bytes()[104] = 1;  // beyond header_length: not a compression type field
  auto img = open_image(b);
  CHECK(img->header().header_length == 104);
  CHECK(img->header().compression_type == CompressionType::kZlib);
}

TEST_CASE("qcow2.header.length_over_104") {
  // A header longer than QEMU's: extensions start at header_length, unknown header bytes skipped.
  ImageSpec s;
  s.header_length = 160;
  s.compression_type = 0;
  s.backing = "/abs/base.qcow2";
  s.backing_format = "qcow2";
  ImageBuilder b(s);
  for (size_t i = 105; i < 160; ++i) b.bytes()[i] = 0xee;  // future header fields
  auto img = open_image(b);
  CHECK(img->header().header_length == 160);
  CHECK(img->header().compression_type == CompressionType::kZlib);
  CHECK(img->backing_format() == std::optional<std::string>("qcow2"));
  CHECK(img->backing_name() == std::optional<std::string>("/abs/base.qcow2"));
}

TEST_CASE("qcow2.header.extensions_preserved") {
  ImageSpec s;
  s.backing = "b.qcow2";
  s.backing_format = "raw";
  s.features = {{0, 0, "dirty bit"},
                {0, 1, "corrupt bit"},
                {1, 0, "lazy refcounts"},
                {2, 0, "bitmaps"},
                {0, 7, "future-incompat"}};
  std::vector<uint8_t> unknown{0xde, 0xad, 0xbe, 0xef, 0x01};  // 5 bytes: padded on disk
  std::vector<uint8_t> unknown2(24, 0x5a);
  std::vector<uint8_t> bitmaps(24, 0);
  put_be(bitmaps, 0, 3, 4);         // nb_bitmaps
  put_be(bitmaps, 8, 96, 8);        // directory size
  put_be(bitmaps, 16, 0x50000, 8);  // directory offset
  s.extensions = {{0x0badc0de, unknown}, {0x23852875, bitmaps}, {0x7777aaaa, unknown2}};
  s.autoclear = 1;
  ImageBuilder b(s);
  auto img = open_image(b);
  const auto& ex = img->extensions();
  REQUIRE(ex.size() == 5);
  CHECK(ex[0].type == 0xe2792aca);
  CHECK(ex[1].type == 0x6803f857);
  CHECK(ex[1].data.size() == 5 * 48);
  CHECK(ex[2].type == 0x0badc0de);
  CHECK(ex[2].data == unknown);  // unpadded payload, bytes intact
  CHECK(ex[3].type == 0x23852875);
  CHECK(ex[4].type == 0x7777aaaa);
  CHECK(ex[4].data == unknown2);
  REQUIRE(img->bitmaps());
  CHECK(img->bitmaps()->nb_bitmaps == 3);
  CHECK(img->bitmaps()->directory_size == 96);
  CHECK(img->bitmaps()->directory_offset == 0x50000);
  CHECK(img->backing_format() == std::optional<std::string>("raw"));

  const auto& fn = img->feature_names();
  REQUIRE(fn.size() == 5);
  CHECK(fn[0].type == 0);
  CHECK(fn[0].bit == 0);
  CHECK(fn[0].name == "dirty bit");
  CHECK(fn[2].type == 1);
  CHECK(fn[2].name == "lazy refcounts");
  CHECK(fn[3].type == 2);
  CHECK(fn[4].bit == 7);
  CHECK(fn[4].name == "future-incompat");
}

TEST_CASE("qcow2.header.feature_name_46_chars_unterminated") {
  ImageSpec s;
  const std::string long_name(46, 'x');  // fills the field: no NUL terminator on disk
  s.features = {{1, 5, long_name}, {1, 6, "short"}};
  ImageBuilder b(s);
  auto img = open_image(b);
  REQUIRE(img->feature_names().size() == 2);
  CHECK(img->feature_names()[0].name == long_name);
  CHECK(img->feature_names()[1].name == "short");
}

TEST_CASE("qcow2.header.data_file_extension") {
  ImageSpec s;
  s.incompatible = 1ull << 2;
  s.autoclear = 2;
  const std::string df = "disk.data";
  s.extensions = {{0x44415441, std::vector<uint8_t>(df.begin(), df.end())}};
  ImageBuilder b(s);
  auto img = open_image(b);
  CHECK(img->has_data_file());
  CHECK(img->data_file_name() == std::optional<std::string>(df));
}

TEST_CASE("qcow2.header.no_end_marker_room") {
  // Extensions may run to the end of cluster 0 without an end marker (QEMU stops there).
  ImageSpec s;
  s.cluster_bits = 9;
  s.size = 1 << 20;
  std::vector<uint8_t> fill(512 - 104 - 8, 0x11);  // exactly to the end of the cluster
  s.extensions = {{0x01020304, fill}};
  ImageBuilder b(s);
  auto img = open_image(b);
  REQUIRE(img->extensions().size() == 1);
  CHECK(img->extensions()[0].data == fill);
}

TEST_CASE("qcow2.header.rewrite_is_the_spec_layout") {
  // The builder lays a header out byte by byte from the specification. An image grown and given
  // another backing file must get exactly the header the builder makes for the new size and name:
  // fixed fields big-endian at their offsets, version 3 fields only in version 3, the bytes past
  // them (the compression type) as they were, extensions padded to 8 bytes, the end marker, then
  // the backing name.
  struct Variant {
    uint32_t version;
    std::optional<uint8_t> compression_type;
  };
  for (const Variant v : {Variant{2, std::nullopt}, Variant{3, std::nullopt}, Variant{3, 1}}) {
    CAPTURE(v.version);
    CAPTURE(v.compression_type.has_value());
    auto spec = [&](uint64_t size, const std::string& backing) {
      ImageSpec s;
      s.version = v.version;
      s.compression_type = v.compression_type;
      s.size = size;  // both sizes need one L1 entry: the same layout
      s.backing = backing;
      s.backing_format = "qcow2";
      if (v.version == 3) s.features = {{0, 0, "dirty bit"}, {1, 0, "lazy refcounts"}};
      s.extensions = {{0x0badc0de, {0xde, 0xad, 0xbe, 0xef, 0x01}}};  // 5 bytes: 3 of padding
      return s;
    };
    const ImageSpec before = spec(64ull << 20, "an older, longer backing name.qcow2");
    const ImageSpec after = spec(128ull << 20, "base.qcow2");
    ImageBuilder b(before);
    auto img = open_image(b);
    qcow2::Writer w(*img);
    w.set_backing(after.backing, after.backing_format);
    w.grow(after.size);
    w.commit();
    ImageBuilder want(after);
    const uint64_t cs = want.cluster_size();
    std::vector<uint8_t> first(cs);
    img->file().read(0, first);
    CHECK(first == std::vector<uint8_t>(want.bytes().begin(), want.bytes().begin() + long(cs)));
  }
}
