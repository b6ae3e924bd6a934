// SPDX-License-Identifier: GPL-2.0-or-later
// merge.crash_*: the merge's write sequence (qcow2::Writer driven window by window, as the engine
// drives it) interrupted at every persistence point and after every single device write, on a
// crash-simulating device. From the surviving bytes: no corruption (leaks allowed), every cluster
// reads its old or its new content, leak repair leaves the image clean, and a resumed run reaches
// the final content. A sample of crashed images is also handed to `qemu-img check`.
#include <doctest/doctest.h>
#include <malloc.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/endian/conversion.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "qcow2/check.h"
#include "qcow2/format.h"
#include "qcow2/image.h"
#include "qcow2/writer.h"
#include "tests/merge/crash_device.h"

namespace qcommit::test {
namespace {

using boost::endian::store_big_u32;
using boost::endian::store_big_u64;
using qcow2::WritePoint;

constexpr uint64_t KiB = 1024, MiB = 1024 * KiB;

// Each crash point copies and frees image-sized buffers (a few MiB) several times. glibc gives
// every buffer above its mmap threshold fresh pages that the kernel faults in and zeroes, and
// unmaps them again on free: that was six sevenths of a sweep's run time
// (merge.crash_write_points_torn 18.4 s → 2.7 s, merge.crash_qemu_img_agrees 63 s → 17 s, on
// 2026-12-02). Keep such buffers on the heap and the heap's top in place.
constexpr int kHeapBufferLimit = 1 << 30;  // bytes
const bool kBuffersOnTheHeap = [] {
  return ::mallopt(M_MMAP_THRESHOLD, kHeapBufferLimit) == 1 && ::mallopt(M_TRIM_THRESHOLD, kHeapBufferLimit) == 1;
}();

// A fresh, empty qcow2 image: header, one refcount table cluster, one refcount block, L1.
std::vector<uint8_t> make_qcow2(uint32_t cluster_bits, uint64_t vsize, uint32_t refcount_order,
                                uint32_t version) {
  qcow2::Geometry g{cluster_bits, false, refcount_order};
  const uint64_t cs = g.cluster_size();
  const uint64_t l1_entries = g.l1_entries_for(vsize);
  const uint64_t l1_clusters = std::max<uint64_t>(1, (l1_entries * 8 + cs - 1) / cs);
  const uint64_t clusters = 3 + l1_clusters;
  REQUIRE(clusters <= g.refcount_block_entries());
  std::vector<uint8_t> img(clusters * cs, 0);
  uint8_t* h = img.data();
  store_big_u32(h + 0, qcow2::kMagic);
  store_big_u32(h + 4, version);
  store_big_u32(h + 20, cluster_bits);
  store_big_u64(h + 24, vsize);
  store_big_u32(h + 36, uint32_t(l1_entries));
  store_big_u64(h + 40, 3 * cs);
  store_big_u64(h + 48, 1 * cs);
  store_big_u32(h + 56, 1);
  if (version >= 3) {
    store_big_u32(h + 96, refcount_order);
    store_big_u32(h + 100, qcow2::kHeaderV3MinBytes);
  }
  store_big_u64(img.data() + cs, 2 * cs);  // refcount table entry 0 → block at cluster 2
  for (uint64_t c = 0; c < clusters; ++c) qcow2::set_refcount_entry(img.data() + 2 * cs, refcount_order, c, 1);
  return img;
}

// The guest view of a single image without a backing file.
std::vector<uint8_t> guest_view(qcow2::Image& img) {
  const uint64_t vs = img.virtual_size();
  std::vector<uint8_t> out(vs, 0);
  for (uint64_t off = 0; off < vs;) {
    qcow2::Run r = img.lookup(off, vs - off);
    REQUIRE(r.length > 0);
    if (r.type == qcow2::SubclusterType::kNormal || r.type == qcow2::SubclusterType::kCompressed)
      img.read_run(r, off, std::span<uint8_t>(out.data() + off, r.length));
    off += r.length;
  }
  return out;
}

uint8_t pattern(size_t window, uint64_t off) {
  uint64_t x = (off / 7 + 1) * 0x9e3779b97f4a7c15ull ^ (uint64_t(window) << 40);
  x ^= x >> 29;
  return uint8_t(x ^ (off >> 9) ^ (window * 37));
}

enum class OpKind { kGrow, kFull, kWrite, kZero };
struct Op {
  OpKind kind;
  uint64_t off = 0, len = 0;
};

struct Scenario {
  std::string name;
  uint32_t cluster_bits;
  uint32_t refcount_order;
  uint32_t version;
  uint64_t unit;  // offsets below are scaled by this
  [[nodiscard]] uint64_t initial_size() const { return 1 * MiB * unit; }
  [[nodiscard]] std::vector<std::vector<Op>> windows() const {
    const uint64_t u = unit;
    // Within a window no cluster is touched twice (so "old or new" is per cluster).
    return {
        {{OpKind::kGrow, 0, 4 * MiB * u}},
        {{OpKind::kFull, 0, 1 * MiB * u},
         {OpKind::kWrite, 1 * MiB * u + 100, 3000},
         {OpKind::kZero, 1536 * KiB * u + 700, 5000 * u}},
        {{OpKind::kFull, 1280 * KiB * u, 1792 * KiB * u},
         {OpKind::kZero, 256 * KiB * u, 64 * KiB * u},
         {OpKind::kWrite, 512 * KiB * u + 10, 100},
         {OpKind::kWrite, 3584 * KiB * u + 1, 2000}},
        {{OpKind::kFull, 0, 512 * KiB * u},
         {OpKind::kZero, 3 * MiB * u - 4 * KiB, 8 * KiB},
         {OpKind::kWrite, 4 * MiB * u - 900, 900}},
    };
  }
};

const std::vector<Scenario>& scenarios() {
  static const std::vector<Scenario> s = {
      {"512B clusters, 64-bit refcounts (refcount table growth)", 9, 6, 3, 1},
      {"4K clusters, compat 0.10", 12, 4, 2, 2},
      {"512B clusters, 1-bit refcounts", 9, 0, 3, 1},
  };
  return s;
}

// Guest views after each window (index 0: before the first one).
std::vector<std::vector<uint8_t>> models(const Scenario& sc) {
  std::vector<std::vector<uint8_t>> m;
  std::vector<uint8_t> v(sc.initial_size(), 0);
  m.push_back(v);
  const auto wins = sc.windows();
  for (size_t w = 0; w < wins.size(); ++w) {
    for (const Op& op : wins[w]) {
      switch (op.kind) {
        case OpKind::kGrow: v.resize(op.len, 0); break;
        case OpKind::kFull:
        case OpKind::kWrite:
          for (uint64_t i = op.off; i < op.off + op.len; ++i) v[i] = pattern(w + 1, i);
          break;
        case OpKind::kZero: std::fill(v.begin() + long(op.off), v.begin() + long(op.off + op.len), 0); break;
      }
    }
    m.push_back(v);
  }
  return m;
}

struct RunResult {
  size_t completed_windows = 0;
  bool crashed = false;
  std::map<WritePoint, uint64_t> points;
  uint64_t point_hits = 0;
};

// Runs windows [from, end) with one Writer on `dev`, committing after each window. Crashes at
// point hit number `crash_at_point` (1-based, 0: never) or whenever the device was armed to.
RunResult run_windows(const Scenario& sc, CrashDevice* dev, size_t from, uint64_t crash_at_point) {
  RunResult res;
  res.completed_windows = from;
  try {
    auto img = qcow2::Image::open(std::make_unique<BorrowedDevice>(*dev), {.writable = true});
    qcow2::Writer w(*img);
    w.on_write_point = [&](WritePoint p) {
      ++res.points[p];
      if (++res.point_hits == crash_at_point) dev->crash();
    };
    qcow2::ViewReader view = [&](uint64_t o, std::span<uint8_t> out) {
      const uint64_t vs = img->virtual_size();
      std::fill(out.begin(), out.end(), uint8_t{0});
      for (uint64_t p = o; p < o + out.size() && p < vs;) {
        qcow2::Run r = img->lookup(p, std::min<uint64_t>(o + out.size(), vs) - p);
        if (r.type == qcow2::SubclusterType::kNormal || r.type == qcow2::SubclusterType::kCompressed)
          img->read_run(r, p, out.subspan(p - o, r.length));
        p += r.length;
      }
    };
    const auto wins = sc.windows();
    for (size_t wi = from; wi < wins.size(); ++wi) {
      for (const Op& op : wins[wi]) {
        std::vector<uint8_t> buf;
        auto fill = [&](uint64_t off, uint64_t len) {
          buf.resize(len);
          for (uint64_t i = 0; i < len; ++i) buf[i] = pattern(wi + 1, off + i);
        };
        switch (op.kind) {
          case OpKind::kGrow: w.grow(op.len); break;
          case OpKind::kFull:
            for (const auto& r : w.prepare_full_write(op.off, op.len)) {
              fill(r.guest_offset, r.length);
              img->data_device().write(r.host_offset, buf);
            }
            break;
          case OpKind::kWrite:
            fill(op.off, op.len);
            w.write(op.off, buf, view);
            break;
          case OpKind::kZero: w.write_zeroes(op.off, op.len, view); break;
        }
      }
      w.commit();
      res.completed_windows = wi + 1;
    }
  } catch (const SimulatedCrash&) {
    res.crashed = true;
  }
  return res;
}

struct Verdict {
  uint64_t leaks = 0;
};

// Everything that must hold for the bytes that survived a crash during window `crashed_window`
// (1-based). Returns the leak count of the first check.
Verdict verify_survivor(const Scenario& sc, const std::vector<std::vector<uint8_t>>& m, size_t crashed_window,
                        std::vector<uint8_t> bytes, const std::string& what) {
  INFO(sc.name << ": " << what << " (crash in window " << crashed_window << ")");
  Verdict v;
  {
    auto img = qcow2::Image::open(std::make_unique<qcow2::MemoryDevice>("crashed", bytes));
    auto r = qcow2::check(*img);
    for (const auto& msg : r.messages) INFO(msg);
    CHECK_MESSAGE(r.corruptions == 0, "check found corruptions after a crash");
    v.leaks = r.leaks;
    const auto& before = m[crashed_window - 1];
    const auto& after = m[crashed_window];
    const uint64_t vs = img->virtual_size();
    CHECK((vs == before.size() || vs == after.size()));
    const auto view = guest_view(*img);
    const uint64_t cs = img->cluster_size();
    uint64_t bad = 0, first_bad = ~0ull;
    for (uint64_t c = 0; c < vs; c += cs) {
      const uint64_t n = std::min(cs, vs - c);
      auto eq = [&](const std::vector<uint8_t>& ref) {
        if (c + n > ref.size()) {
          // Past the model's size the guest reads zeros.
          for (uint64_t i = 0; i < n; ++i)
            if (view[c + i] != (c + i < ref.size() ? ref[c + i] : 0)) return false;
          return true;
        }
        return std::equal(view.begin() + long(c), view.begin() + long(c + n), ref.begin() + long(c));
      };
      if (!eq(before) && !eq(after)) {
        ++bad;
        first_bad = std::min(first_bad, c);
      }
    }
    CHECK_MESSAGE(bad == 0, bad << " clusters read neither old nor new content, first at guest offset " << first_bad);
  }
  // Leak repair leaves it clean.
  qcow2::MemoryDevice mem("crashed", bytes);
  {
    auto img = qcow2::Image::open(std::make_unique<BorrowedDevice>(mem), {.writable = true});
    auto r = qcow2::check(*img, qcow2::Repair::kLeaks);
    CHECK(r.corruptions == 0);
    CHECK(r.leaks_fixed == r.leaks);
  }
  std::vector<uint8_t> repaired = mem.bytes();
  {
    auto img = qcow2::Image::open(std::make_unique<qcow2::MemoryDevice>("repaired", repaired));
    auto r = qcow2::check(*img);
    CHECK_MESSAGE((r.corruptions == 0 && r.leaks == 0), "not clean after leak repair");
  }
  // Resume: redo the interrupted window and the rest; the result is the final content.
  auto cdev = std::make_unique<CrashDevice>("resumed", repaired);
  auto* cd = cdev.get();
  auto rr = run_windows(sc, cd, crashed_window - 1, 0);
  REQUIRE_FALSE(rr.crashed);
  auto img = qcow2::Image::open(std::make_unique<qcow2::MemoryDevice>("resumed", cd->durable()));
  auto r = qcow2::check(*img);
  CHECK_MESSAGE((r.corruptions == 0 && r.leaks == 0), "resumed run did not leave a clean image");
  CHECK_MESSAGE(guest_view(*img) == m.back(), "resumed run does not reach the final content");
  return v;
}

std::vector<uint8_t> initial_bytes(const Scenario& sc) {
  return make_qcow2(sc.cluster_bits, sc.initial_size(), sc.refcount_order, sc.version);
}

// A crash test: for each k in 1..(number of events in a clean run), crash at event k.
enum class Mode { kPoints, kWrites };

struct Sample {
  std::vector<uint8_t> bytes;
  uint64_t our_leaks;
  std::string what;
};

void crash_everywhere(Mode mode, int torn_seeds, std::vector<Sample>* samples = nullptr, uint64_t sample_every = 0) {
  for (const auto& sc : scenarios()) {
    const auto m = models(sc);
    // Clean run: final content, event counts, every persistence point reached.
    auto d0 = std::make_unique<CrashDevice>("clean", initial_bytes(sc));
    auto* dev0 = d0.get();
    auto clean = run_windows(sc, dev0, 0, 0);
    REQUIRE_FALSE(clean.crashed);
    {
      auto img = qcow2::Image::open(std::make_unique<qcow2::MemoryDevice>("clean", dev0->durable()));
      auto r = qcow2::check(*img);
      CHECK(r.corruptions == 0);
      CHECK(r.leaks == 0);
      CHECK(guest_view(*img) == m.back());
    }
    if (sc.refcount_order == 6) {  // the scenario built to reach every point
      for (WritePoint p : {WritePoint::kDataFlush, WritePoint::kRefcountBlocks, WritePoint::kRefcountTable,
                           WritePoint::kHeaderForRefcountTable, WritePoint::kL2Tables, WritePoint::kL1Table,
                           WritePoint::kHeader, WritePoint::kRefcountDecrements})
        CHECK_MESSAGE(clean.points[p] > 0, "scenario never reaches " << to_string(p));
    }
    const uint64_t events = mode == Mode::kPoints ? clean.point_hits : dev0->writes();
    MESSAGE(sc.name << ": " << events << std::string(mode == Mode::kPoints ? " persistence points" : " device writes"));
    uint64_t crashes = 0, leaky = 0;
    for (uint64_t k = 1; k <= events; ++k) {
      auto d = std::make_unique<CrashDevice>("crash", initial_bytes(sc));
      auto* dev = d.get();
      if (mode == Mode::kWrites) dev->crash_after_write(k);
      auto rr = run_windows(sc, dev, 0, mode == Mode::kPoints ? k : 0);
      REQUIRE(rr.crashed);
      ++crashes;
      const size_t win = rr.completed_windows + 1;
      const std::string what = std::string(mode == Mode::kPoints ? "point hit " : "write ") + std::to_string(k);
      if (torn_seeds == 0) {
        auto v = verify_survivor(sc, m, win, dev->durable(), what + ", unflushed writes dropped");
        if (v.leaks) ++leaky;
        if (samples && sample_every && k % sample_every == 0)
          samples->push_back({dev->durable(), v.leaks, sc.name + " " + what});
      }
      for (int s = 0; s < torn_seeds; ++s) {
        std::mt19937_64 rng(k * 1000 + uint64_t(s));
        auto bytes = dev->torn(rng);
        auto v = verify_survivor(sc, m, win, bytes, what + ", torn seed " + std::to_string(s));
        if (v.leaks) ++leaky;
        if (samples && sample_every && k % sample_every == 0 && s == 0)
          samples->push_back({bytes, v.leaks, sc.name + " " + what + " torn"});
      }
    }
    MESSAGE(sc.name << ": " << crashes << " crashes verified, " << leaky << " survivors had leaks");
  }
}

}  // namespace

TEST_CASE("merge.crash_device") {
  CrashDevice d("d", std::vector<uint8_t>(1024, 1));
  const std::vector<uint8_t> two(100, 2), three(100, 3);
  d.write(0, two);
  std::vector<uint8_t> r(100);
  d.read(0, r);
  CHECK(r == two);  // reads see unflushed writes
  CHECK(d.durable()[0] == 1);
  d.flush();
  CHECK(d.durable()[0] == 2);
  d.write(200, three);
  d.truncate(2048);
  CHECK(d.current().size() == 2048);
  CHECK(d.durable().size() == 1024);  // the truncate is not durable yet
  CHECK(d.durable()[200] == 1);
  std::mt19937_64 rng(1);
  int kept = 0;
  for (int i = 0; i < 64; ++i) kept += d.torn(rng)[200] == 3;
  CHECK(kept > 0);
  CHECK(kept < 64);
  d.crash_after_write(d.writes() + 1);
  CHECK_THROWS_AS(d.write(0, three), SimulatedCrash);
  CHECK_THROWS_AS(d.read(0, r), SimulatedCrash);  // dead after the crash
  CHECK(d.durable()[0] == 2);
}

// A child rebased past the end of a shorter TOP (engine/rebase.h) is given zeros and the header
// naming its new backing file in one commit. Crashed after every device write, with the unflushed
// writes lost or written back in any order: wherever the surviving header names the new backing
// file, the zeroed range reads as zeros in the child itself (zero flags or zero data), never
// through to the backing file. v3 (flags) and v2 (zero data); the range starts inside a cluster.
TEST_CASE("merge.crash_child_zeros_before_backing") {
  constexpr uint64_t kFrom = 1 * MiB + 4 * KiB, kTo = 3 * MiB;
  constexpr int kTornSeeds = 16;
  for (const uint32_t version : {3u, 2u}) {
    const std::vector<uint8_t> initial = make_qcow2(16, 4 * MiB, 4, version);
    int named = 0;
    for (uint64_t k = 1;; ++k) {
      auto dev = std::make_unique<CrashDevice>("child", initial);
      dev->crash_after_write(k);
      bool crashed = false;
      try {
        auto img = qcow2::Image::open(std::make_unique<BorrowedDevice>(*dev), {.writable = true});
        qcow2::Writer w(*img);
        w.set_backing("base.qcow2", "qcow2");
        const qcow2::ViewReader old_view = [](uint64_t, std::span<uint8_t> out) {
          std::fill(out.begin(), out.end(), uint8_t{0});
        };
        w.write_zeroes(kFrom, kTo - kFrom, old_view);
        w.commit();
      } catch (const SimulatedCrash&) {
        crashed = true;
      }
      for (int s = 0; s <= (crashed ? kTornSeeds : 0); ++s) {
        std::mt19937_64 rng(k * 1000 + uint64_t(s));
        auto img = qcow2::Image::open(std::make_unique<qcow2::MemoryDevice>("crashed", s == 0 ? dev->durable() : dev->torn(rng)));
        if (img->backing_name() != "base.qcow2") continue;
        ++named;
        for (uint64_t off = kFrom; off < kTo;) {
          const qcow2::Run r = img->lookup(off, kTo - off);
          REQUIRE(r.length > 0);
          CHECK_MESSAGE((r.type != qcow2::SubclusterType::kUnallocatedPlain &&
                         r.type != qcow2::SubclusterType::kUnallocatedAlloc),
                        "v" << version << ", crash after write " << k << ", seed " << s
                            << ": the header names the backing file, " << off << " reads through to it");
          if (r.type == qcow2::SubclusterType::kNormal) {
            std::vector<uint8_t> data(r.length);
            img->read_run(r, off, data);
            CHECK(std::all_of(data.begin(), data.end(), [](uint8_t b) { return b == 0; }));
          }
          off += r.length;
        }
      }
      if (!crashed) break;
    }
    CHECK(named > 0);
  }
}

TEST_CASE("merge.crash_write_points") { crash_everywhere(Mode::kPoints, 0); }
TEST_CASE("merge.crash_write_points_torn") { crash_everywhere(Mode::kPoints, 3); }
TEST_CASE("merge.crash_every_write") { crash_everywhere(Mode::kWrites, 0); }
TEST_CASE("merge.crash_every_write_torn") { crash_everywhere(Mode::kWrites, 1); }

// qemu-img check agrees with us on crashed images: no errors, the same leak count.
TEST_CASE("merge.crash_qemu_img_agrees") {
  std::vector<Sample> samples;
  crash_everywhere(Mode::kPoints, 0, &samples, 2);
  crash_everywhere(Mode::kWrites, 1, &samples, 29);
  REQUIRE(samples.size() >= 10);
  char tmpl[] = "/var/tmp/qcommit-crash.XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  uint64_t with_leaks = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    INFO(samples[i].what);
    const std::string path = dir + "/crashed-" + std::to_string(i) + ".qcow2";
    {
      std::ofstream f(path, std::ios::binary);
      f.write(reinterpret_cast<const char*>(samples[i].bytes.data()), std::streamsize(samples[i].bytes.size()));
    }
    const std::string cmd = "qemu-img check -f qcow2 --output=json '" + path + "' 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    REQUIRE(p != nullptr);
    std::string out;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    const int st = pclose(p);
    const int code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    INFO("qemu-img check: exit " << code << ": " << out);
    auto field = [&](const char* key) -> uint64_t {
      std::smatch mm;
      if (std::regex_search(out, mm, std::regex(std::string("\"") + key + "\": *([0-9]+)")))
        return std::stoull(mm[1]);
      return 0;
    };
    CHECK(field("corruptions") == 0);
    CHECK(field("check-errors") == 0);
    CHECK(field("leaks") == samples[i].our_leaks);
    CHECK(code == (samples[i].our_leaks ? 3 : 0));
    if (samples[i].our_leaks) ++with_leaks;
    std::remove(path.c_str());
  }
  rmdir(dir.c_str());
  MESSAGE(samples.size() << " crashed images checked by qemu-img, " << with_leaks << " with leaks");
  CHECK(with_leaks > 0);  // the sample must include leaky images, or it proves little
}

}  // namespace qcommit::test
