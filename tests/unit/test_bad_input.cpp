// SPDX-License-Identifier: GPL-2.0-or-later
// Bad input: every case must end in a clear one-line error that names the file, never a crash,
// never an allocation proportional to a corrupt header field.
#include <doctest/doctest.h>
#include <zlib.h>

#include "qcow2/chain.h"
#include "tests/unit/helpers.h"

using namespace qcommit;
using namespace qcommit::test;
using qcow2::CorruptionError;
using qcow2::Error;
using qcow2::UnsupportedError;

namespace {

const std::string kName = "mem.qcow2";

std::vector<uint8_t> valid(uint32_t cluster_bits = 16) {
  ImageSpec s;
  s.cluster_bits = cluster_bits;
  s.size = 16ull << 20;
  ImageBuilder b(s);
  b.write_cluster(0, 0x11);
  return b.bytes();
}

template <class E>
void expect_open_error(std::vector<uint8_t> bytes, const std::string& needle) {
  expect_error<E>([&] { (void)open_bytes(std::move(bytes), kName); }, kName, needle);
}

}  // namespace

TEST_CASE("qcow2.bad.truncated") {
  auto v = valid();
  for (size_t n : {0, 3, 4, 50, 71}) {
    CAPTURE(n);
    expect_open_error<Error>(std::vector<uint8_t>(v.begin(), v.begin() + long(n)), "too small");
  }
  // A v3 header cut between the v2 and v3 parts.
  expect_open_error<Error>(std::vector<uint8_t>(v.begin(), v.begin() + 90), "too small");
  // Header intact, tables cut off.
  expect_open_error<CorruptionError>(std::vector<uint8_t>(v.begin(), v.begin() + 65536), "beyond end of file");
  expect_open_error<CorruptionError>(std::vector<uint8_t>(v.begin(), v.begin() + 65536 * 2 + 4),
                                     "beyond end of file");
}

TEST_CASE("qcow2.bad.magic") {
  auto v = valid();
  v[3] = 0xfc;
  expect_open_error<Error>(v, "bad magic");
  std::vector<uint8_t> zeros(1 << 20, 0);
  expect_open_error<Error>(zeros, "bad magic");
}

TEST_CASE("qcow2.bad.version") {
  for (uint32_t ver : {0u, 1u, 4u, 0xffffffffu}) {
    CAPTURE(ver);
    auto v = valid();
    put_be(v, 4, ver, 4);
    expect_open_error<UnsupportedError>(v, "version " + std::to_string(ver));
  }
}

TEST_CASE("qcow2.bad.cluster_bits") {
  for (uint32_t bits : {0u, 8u, 22u, 31u, 63u, 64u, 0xffffffffu}) {
    CAPTURE(bits);
    auto v = valid();
    put_be(v, 20, bits, 4);
    expect_open_error<Error>(v, "cluster size");
  }
}

TEST_CASE("qcow2.bad.header_fields") {
  SUBCASE("header_length below 104") {
    auto v = valid();
    put_be(v, 100, 96, 4);
    expect_open_error<CorruptionError>(v, "header_length 96");
  }
  SUBCASE("header_length not a multiple of 8") {
    auto v = valid();
    put_be(v, 100, 108, 4);
    expect_open_error<CorruptionError>(v, "multiple of 8");
  }
  SUBCASE("header_length beyond the cluster") {
    auto v = valid(9);
    put_be(v, 100, 1024, 4);
    expect_open_error<CorruptionError>(v, "exceeds the cluster size");
  }
  SUBCASE("refcount_order 7") {
    auto v = valid();
    put_be(v, 96, 7, 4);
    expect_open_error<CorruptionError>(v, "refcount_order 7");
  }
  SUBCASE("unknown compression type") {
    ImageSpec s;
    s.compression_type = 2;
    ImageBuilder b(s);
    expect_open_error<UnsupportedError>(b.bytes(), "compression type 2");
  }
  SUBCASE("zstd without the feature bit") {
    ImageSpec s;
    s.compression_type = 1;
    ImageBuilder b(s);
    b.put64(72, 0);
    expect_open_error<CorruptionError>(b.bytes(), "compression");
  }
  SUBCASE("extended L2 with small clusters") {
    ImageSpec s;
    s.cluster_bits = 12;
    s.incompatible = 1ull << 4;
    ImageBuilder b(s);
    expect_open_error<CorruptionError>(b.bytes(), "extended L2");
  }
  SUBCASE("extension overruns the header area") {
    ImageSpec s;
    s.cluster_bits = 12;
    s.extensions = {{0x01020304, std::vector<uint8_t>(16, 1)}};
    ImageBuilder b(s);
    b.put32(104 + 4, 1u << 20);  // its length
    expect_open_error<CorruptionError>(b.bytes(), "overruns");
  }
  SUBCASE("too many snapshots") {
    auto v = valid();
    put_be(v, 60, 1u << 20, 4);
    put_be(v, 64, 65536 * 2, 8);
    expect_open_error<CorruptionError>(v, "snapshots");
  }
  SUBCASE("snapshot table beyond end of file") {
    auto v = valid();
    put_be(v, 60, 1, 4);
    put_be(v, 64, 1ull << 40, 8);
    expect_open_error<CorruptionError>(v, "snapshot table");
  }
  SUBCASE("data file bit without a name is fine for Image, named data file without the bit is not") {
    ImageSpec s;
    const std::string df = "x.data";
    s.extensions = {{0x44415441, std::vector<uint8_t>(df.begin(), df.end())}};
    ImageBuilder b(s);
    expect_open_error<CorruptionError>(b.bytes(), "data file");
  }
}

TEST_CASE("qcow2.bad.l1_table") {
  SUBCASE("unaligned") {
    auto v = valid();
    put_be(v, 40, 65536 * 2 + 512, 8);
    expect_open_error<CorruptionError>(v, "not cluster aligned");
  }
  SUBCASE("at offset 0") {
    auto v = valid();
    put_be(v, 40, 0, 8);
    expect_open_error<CorruptionError>(v, "overlaps the header");
  }
  SUBCASE("beyond end of file") {
    auto v = valid();
    put_be(v, 40, 1ull << 40, 8);
    expect_open_error<CorruptionError>(v, "beyond end of file");
  }
  SUBCASE("offset near 2^64 does not wrap") {
    auto v = valid();
    put_be(v, 40, ~0ull << 16, 8);
    expect_open_error<CorruptionError>(v, "beyond end of file");
  }
  SUBCASE("l1_size needing gigabytes") {
    auto v = valid();
    put_be(v, 36, 0xffffffffu, 4);
    expect_open_error<CorruptionError>(v, "larger than 32 MiB");
    put_be(v, 36, 0x10000000u, 4);  // 2 GiB of L1
    expect_open_error<CorruptionError>(v, "larger than 32 MiB");
  }
  SUBCASE("l1_size too small for the virtual size") {
    auto v = valid();
    put_be(v, 24, 1ull << 50, 8);
    expect_open_error<CorruptionError>(v, "needed for the virtual size");
  }
  SUBCASE("virtual size near 2^64") {
    auto v = valid();
    put_be(v, 24, ~0ull - 511, 8);
    expect_open_error<CorruptionError>(v, "needed for the virtual size");  // no wrap-around
  }
}

TEST_CASE("qcow2.bad.refcount_table") {
  SUBCASE("unaligned") {
    auto v = valid();
    put_be(v, 48, 65536 + 8, 8);
    expect_open_error<CorruptionError>(v, "refcount table offset");
  }
  SUBCASE("zero offset") {
    auto v = valid();
    put_be(v, 48, 0, 8);
    expect_open_error<CorruptionError>(v, "refcount table offset");
  }
  SUBCASE("beyond end of file") {
    auto v = valid();
    put_be(v, 48, 1ull << 40, 8);
    expect_open_error<CorruptionError>(v, "beyond end of file");
  }
  SUBCASE("too many clusters") {
    auto v = valid();
    put_be(v, 56, 0xffffffffu, 4);
    expect_open_error<CorruptionError>(v, "larger than 8 MiB");
  }
  SUBCASE("no clusters") {
    auto v = valid();
    put_be(v, 56, 0, 4);
    expect_open_error<CorruptionError>(v, "no refcount table");
  }
}

TEST_CASE("qcow2.bad.l2_entries") {
  ImageSpec s;
  s.cluster_bits = 16;
  s.size = 1ull << 30;
  SUBCASE("L2 table unaligned") {
    ImageBuilder b(s);
    b.put64(b.l1_offset(), (1ull << 63) | (3 * 65536 + 512));
    auto img = open_image(b);
    expect_error<CorruptionError>([&] { (void)img->lookup(0, 4096); }, kName, "not cluster aligned");
  }
  SUBCASE("L2 table in the header") {
    ImageBuilder b(s);
    b.put64(b.l1_offset() + 8, 0x200);
    auto img = open_image(b);
    expect_error<CorruptionError>([&] { (void)img->lookup(512ull << 20, 4096); }, kName, "L2 table");
  }
  SUBCASE("L2 table beyond end of file") {
    ImageBuilder b(s);
    b.put64(b.l1_offset(), 1ull << 40);
    auto img = open_image(b);
    expect_error<CorruptionError>([&] { (void)img->lookup(0, 4096); }, kName, "beyond end of file");
  }
  SUBCASE("data cluster pointing into the header") {
    ImageBuilder b(s);
    b.set_l2(0, (1ull << 63) | 0x200);
    auto img = open_image(b);
    expect_error<CorruptionError>([&] { (void)img->lookup(0, 4096); }, kName, "L2 table at");
  }
  SUBCASE("data cluster unaligned") {
    ImageBuilder b(s);
    b.set_l2(0, (1ull << 63) | (5 * 65536 + 4096));
    auto img = open_image(b);
    expect_error<CorruptionError>([&] { (void)img->lookup(0, 4096); }, kName, "not cluster aligned");
  }
  SUBCASE("compressed data in the header") {
    ImageBuilder b(s);
    b.set_l2(0, (1ull << 62) | 0x100);
    auto img = open_image(b);
    expect_error<CorruptionError>([&] { (void)img->lookup(0, 4096); }, kName, "overlaps the image header");
  }
}

TEST_CASE("qcow2.bad.unknown_incompatible_bits") {
  SUBCASE("named through the feature table") {
    ImageSpec s;
    s.incompatible = 1ull << 9;
    s.features = {{0, 9, "frobnication"}, {1, 9, "not this one"}};
    ImageBuilder b(s);
    expect_open_error<UnsupportedError>(b.bytes(), "bit 9 (frobnication)");
  }
  SUBCASE("without a feature table") {
    ImageSpec s;
    s.incompatible = (1ull << 5) | (1ull << 63);
    ImageBuilder b(s);
    expect_open_error<UnsupportedError>(b.bytes(), "bit 5, bit 63");
  }
  SUBCASE("unknown compatible and autoclear bits are fine") {
    ImageSpec s;
    s.compatible = 1ull << 40;
    s.autoclear = 1ull << 40;
    ImageBuilder b(s);
    CHECK_NOTHROW((void)open_image(b));
  }
}

TEST_CASE("qcow2.bad.encryption") {
  for (uint32_t method : {1u, 2u, 7u}) {
    CAPTURE(method);
    auto v = valid();
    put_be(v, 32, method, 4);
    expect_open_error<UnsupportedError>(v, "encrypt");
  }
}

TEST_CASE("qcow2.bad.backing_name_too_long") {
  ImageSpec s;
  s.backing = std::string(1024, 'b');
  ImageBuilder b(s);
  expect_open_error<CorruptionError>(b.bytes(), "backing file name too long");
  ImageSpec ok;
  ok.backing = std::string(1023, 'b');
  ImageBuilder b2(ok);
  CHECK(open_image(b2)->backing_name()->size() == 1023);
  // Name running past the end of the first cluster.
  auto v = b2.bytes();
  put_be(v, 8, 65536 - 10, 8);
  expect_open_error<CorruptionError>(v, "backing file name");
}

TEST_CASE("qcow2.bad.compressed_garbage") {
  for (uint8_t ct : {uint8_t{0}, uint8_t{1}}) {
    CAPTURE(int(ct));
    ImageSpec s;
    s.cluster_bits = 12;
    s.size = 1 << 20;
    s.compression_type = ct;
    ImageBuilder b(s);
    std::vector<uint8_t> junk(700);
    for (size_t i = 0; i < junk.size(); ++i) junk[i] = uint8_t(i * 131 + 7);
    b.write_compressed(4096, junk);
    // A valid stream that is too short (decompresses to half a cluster).
    std::vector<uint8_t> half(2048, 0x42);
    std::vector<uint8_t> short_stream;
    if (ct == 0) {
      z_stream z{};
      REQUIRE(deflateInit2(&z, 6, Z_DEFLATED, -12, 9, Z_DEFAULT_STRATEGY) == Z_OK);
      short_stream.resize(4096);
      z.next_in = half.data();
      z.avail_in = uInt(half.size());
      z.next_out = short_stream.data();
      z.avail_out = uInt(short_stream.size());
      REQUIRE(deflate(&z, Z_FINISH) == Z_STREAM_END);
      short_stream.resize(z.total_out);
      deflateEnd(&z);
    } else {
      short_stream.assign(junk.begin(), junk.begin() + 100);
    }
    b.write_compressed(2 * 4096, short_stream);
    auto img = open_image(b);
    for (uint64_t guest : {4096ull, 8192ull}) {
      CAPTURE(guest);
      qcow2::Run r = img->lookup(guest, 4096);
      REQUIRE(r.type == qcow2::SubclusterType::kCompressed);
      std::vector<uint8_t> out(512);
      expect_error<CorruptionError>([&] { img->read_run(r, guest, out); }, kName, "does not decompress");
    }
  }
}

TEST_CASE("qcow2.bad.compressed_beyond_end_of_file") {
  ImageSpec s;
  s.cluster_bits = 12;
  s.size = 1 << 20;
  ImageBuilder b(s);
  b.set_l2(0, b.compressed_descriptor(1ull << 40, 600));
  auto img = open_image(b);
  qcow2::Run r = img->lookup(0, 4096);
  std::vector<uint8_t> out(4096);
  expect_error<CorruptionError>([&] { img->read_run(r, 0, out); }, kName, "beyond end of file");
}

// ---------------------------------------------------------------------------------------------
// Chains on disk.

namespace {
std::vector<uint8_t> with_backing(const std::string& backing, std::optional<std::string> fmt = {}) {
  ImageSpec s;
  s.size = 1 << 20;
  s.backing = backing;
  s.backing_format = std::move(fmt);
  return ImageBuilder(s).bytes();
}
}  // namespace

TEST_CASE("qcow2.bad.backing_loop") {
  TempDir d;
  const auto a = d.write("a.qcow2", with_backing("b.qcow2"));
  const auto b = d.write("b.qcow2", with_backing("a.qcow2", "qcow2"));
  expect_error<Error>([&] { (void)qcow2::Chain::open(a); }, b, "loop");
  // A self-reference through a different spelling of the same file.
  const auto c = d.write("c.qcow2", with_backing("./../" + d.path.filename().string() + "/c.qcow2"));
  expect_error<Error>([&] { (void)qcow2::Chain::open(c); }, c, "loop");
}

TEST_CASE("qcow2.bad.backing_missing") {
  TempDir d;
  const auto top = d.write("top.qcow2", with_backing("nowhere.qcow2"));
  expect_error<Error>([&] { (void)qcow2::Chain::open(top); }, top, "nowhere.qcow2");
  expect_error<qcow2::IoError>([&] { (void)qcow2::Chain::open(d.file("absent.qcow2")); },
                               d.file("absent.qcow2"), "No such file");
}

TEST_CASE("qcow2.bad.backing_json_and_protocols") {
  TempDir d;
  for (const std::string& name :
       {std::string("json:{\"driver\":\"qcow2\",\"file\":{\"filename\":\"x\"}}"),
        std::string("nbd://host:10809/export"), std::string("http://example.com/x.img"),
        std::string("nbd:unix:/tmp/sock"), std::string("ssh://user@host/path")}) {
    CAPTURE(name);
    const auto top = d.write("top.qcow2", with_backing(name));
    expect_error<UnsupportedError>([&] { (void)qcow2::Chain::open(top); }, top,
                                   name.rfind("json:", 0) == 0 ? "json:" : "protocol");
  }
  // file: prefix and names with a colon after a slash are plain files. As QEMU: a relative name
  // is joined to the image's directory textually (the kernel resolves '..' and symlinks); a
  // file: name is used as is (relative to the working directory).
  CHECK(qcow2::resolve_backing("/d/top.qcow2", "file:base.qcow2") == "base.qcow2");
  CHECK(qcow2::resolve_backing("/d/top.qcow2", "./x:y.qcow2") == "/d/./x:y.qcow2");
  CHECK(qcow2::resolve_backing("/d/top.qcow2", "/abs/b.qcow2") == "/abs/b.qcow2");
  CHECK(qcow2::resolve_backing("/d/e/top.qcow2", "../b.qcow2") == "/d/e/../b.qcow2");
}

TEST_CASE("qcow2.bad.backing_format_unsupported") {
  TempDir d;
  d.write("base.vmdk", std::vector<uint8_t>(4096, 0));
  const auto top = d.write("top.qcow2", with_backing("base.vmdk", "vmdk"));
  expect_error<UnsupportedError>([&] { (void)qcow2::Chain::open(top); }, top, "vmdk");
}

TEST_CASE("qcow2.bad.backing_named_qcow2_but_raw") {
  TempDir d;
  d.write("base.img", std::vector<uint8_t>(1 << 20, 0x5a));
  const auto top = d.write("top.qcow2", with_backing("base.img", "qcow2"));
  expect_error<Error>([&] { (void)qcow2::Chain::open(top); }, d.file("base.img"), "bad magic");
}

TEST_CASE("qcow2.bad.data_file_missing") {
  TempDir d;
  ImageSpec s;
  s.incompatible = 1ull << 2;
  const std::string df = "gone.data";
  s.extensions = {{0x44415441, std::vector<uint8_t>(df.begin(), df.end())}};
  const auto top = d.write("top.qcow2", ImageBuilder(s).bytes());
  expect_error<Error>([&] { (void)qcow2::Chain::open(top); }, top, "gone.data");
  ImageSpec s2;
  s2.incompatible = 1ull << 2;
  const auto top2 = d.write("top2.qcow2", ImageBuilder(s2).bytes());
  expect_error<Error>([&] { (void)qcow2::Chain::open(top2); }, top2, "does not name it");
}
