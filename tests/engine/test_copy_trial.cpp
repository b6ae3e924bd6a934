// SPDX-License-Identifier: GPL-2.0-or-later
// `qcommit plan --measure`'s rehearsal (engine/copy_trial.h): the ETA computed from a rehearsal's
// completions, on made-up rehearsals (no clock involved), and one real rehearsal into a scratch
// file that must leave nothing behind.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/copy_trial.h"

using namespace qcommit::engine;

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// A rehearsal whose requests of `request` bytes complete at `rate(t)` bytes/s for `seconds`
// (one completion per request), then an fdatasync of `sync_s`.
CopyTrial made_up(double seconds, uint64_t request, double sync_s, double (*rate)(double)) {
  CopyTrial t;
  double at = 0, owed = 0;
  const double step = 0.001;
  for (double s = 0; s < seconds; s += step) {
    owed += rate(s) * step;
    while (owed >= double(request)) {
      owed -= double(request);
      t.bytes += request;
      t.completions.emplace_back(s + step, t.bytes);
    }
    at = s + step;
  }
  t.seconds = at + sync_s;
  return t;
}

}  // namespace

TEST_CASE("engine.copy_trial.estimate") {
  SUBCASE("a rehearsal that copied all the data is the ETA") {
    CopyTrial t = made_up(1.0, 1 << 20, 0.1, [](double) { return 64 * kMiB; });
    const CopyEstimate e = estimate_copy_time(32 << 20, t);
    CHECK(e.seconds == doctest::Approx(t.seconds * 32 * kMiB / double(t.bytes)));
    CHECK(e.low_seconds == e.seconds);
    CHECK(e.high_seconds == e.seconds);
  }
  SUBCASE("slow start is counted once, the rest goes at the second half's rate") {
    // 32 MiB/s doubling every 250 ms up to 128 MiB/s (the governor's slow start), for 3 s.
    CopyTrial t = made_up(3.0, 1 << 20, 0.05, [](double s) {
      return std::min(128 * kMiB, 32 * kMiB * std::exp2(s / 0.25));
    });
    t.governed = true;  // its rate stopped growing: the rest goes at the rate it reached
    const uint64_t data = 2ull << 30;
    const CopyEstimate e = estimate_copy_time(data, t);
    CHECK(e.rate_bytes_per_s == doctest::Approx(128 * kMiB).epsilon(0.02));
    const double rest = double(data - t.bytes);
    CHECK(e.seconds == doctest::Approx(t.seconds + rest / (128 * kMiB)).epsilon(0.02));
    // The whole rehearsal's average would have promised less: slow start is not extrapolated.
    CHECK(e.seconds < t.seconds + rest / (double(t.bytes) / t.seconds));
    CHECK(e.low_seconds <= e.seconds);
    CHECK(e.high_seconds >= e.seconds);
    CHECK(e.high_seconds - e.low_seconds < 0.05 * e.seconds);  // a steady second half
  }
  SUBCASE("the range spans the slower and the faster half of the second half") {
    // 0-2 s at 100 MiB/s, then 2-3 s at 40 MiB/s and 3-4 s at 80 MiB/s.
    CopyTrial t = made_up(4.0, 256 << 10, 0.0, [](double s) {
      if (s < 2.0) return 100 * kMiB;
      return s < 3.0 ? 40 * kMiB : 80 * kMiB;
    });
    const uint64_t data = 4ull << 30;
    const CopyEstimate e = estimate_copy_time(data, t);
    const double rest = double(data - t.bytes);
    CHECK(e.rate_bytes_per_s == doctest::Approx(60 * kMiB).epsilon(0.03));
    CHECK(e.low_seconds == doctest::Approx(t.seconds + rest / (80 * kMiB)).epsilon(0.03));
    CHECK(e.high_seconds == doctest::Approx(t.seconds + rest / (40 * kMiB)).epsilon(0.03));
  }
  SUBCASE("a pause (nothing completes for 0.5 s) slows the rest and widens the range") {
    CopyTrial t =
        made_up(4.0, 1 << 20, 0.0, [](double s) { return s >= 3.0 && s < 3.5 ? 0.0 : 50 * kMiB; });
    const uint64_t data = 1ull << 30;
    const CopyEstimate e = estimate_copy_time(data, t);
    const double rest = double(data - t.bytes);
    CHECK(e.rate_bytes_per_s == doctest::Approx(37.5 * kMiB).epsilon(0.05));
    CHECK(e.low_seconds == doctest::Approx(t.seconds + rest / (50 * kMiB)).epsilon(0.05));
    CHECK(e.high_seconds == doctest::Approx(t.seconds + rest / (25 * kMiB)).epsilon(0.05));
  }
  SUBCASE("a governed rate still growing goes on growing, up to the ceiling") {
    // The controller's additive increase: 50 MiB/s + 200 MiB/s per second, for 3 s.
    CopyTrial t = made_up(3.0, 1 << 20, 0.0, [](double s) { return 50 * kMiB + 200 * kMiB * s; });
    t.governed = true;
    const double at_end = 650 * kMiB, growth = 200 * kMiB;
    const uint64_t data = 4ull << 30;
    const double rest = double(data - t.bytes);
    // Without a ceiling: rest = at_end * x + growth * x^2 / 2.
    const double x = (std::sqrt(at_end * at_end + 2 * growth * rest) - at_end) / growth;
    CopyEstimate e = estimate_copy_time(data, t);
    CHECK(e.seconds == doctest::Approx(t.seconds + x).epsilon(0.03));
    CHECK(e.low_seconds <= e.seconds);
    // No growth at the second half's slower rate: the high end.
    CHECK(e.high_seconds == doctest::Approx(t.seconds + rest / (425 * kMiB)).epsilon(0.03));
    // A ceiling of 1 GiB/s: reached after (1024 - 650) / 200 s, the rest at the ceiling.
    t.ceiling_bytes_per_s = 1024 * kMiB;
    const double t_cap = (1024 - 650) / 200.0;
    const double ramp = at_end * t_cap + growth * t_cap * t_cap / 2;
    e = estimate_copy_time(data, t);
    CHECK(e.seconds ==
          doctest::Approx(t.seconds + t_cap + (rest - ramp) / (1024 * kMiB)).epsilon(0.03));
    // Unthrottled, the same rehearsal is not extrapolated: the second half's rate.
    t.governed = false;
    e = estimate_copy_time(data, t);
    CHECK(e.seconds == doctest::Approx(t.seconds + rest / (500 * kMiB)).epsilon(0.03));
  }
  SUBCASE("nothing rehearsed: no estimate") {
    const CopyEstimate e = estimate_copy_time(1 << 30, CopyTrial{});
    CHECK(e.seconds == 0);
    CHECK(e.rate_bytes_per_s == 0);
  }
}

TEST_CASE("engine.copy_trial.rehearses_the_copy") {
  // A real rehearsal: 8 MiB of a source file copied into a scratch file beside it; everything
  // copied, every request counted, nothing left in the directory.
  char dir[] = "/tmp/qcommit-trial-XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  const std::string src = std::string(dir) + "/top.qcow2";
  {
    std::vector<char> buf(8 << 20, 'q');
    const int fd = ::open(src.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    REQUIRE(::write(fd, buf.data(), buf.size()) == static_cast<ssize_t>(buf.size()));
    ::close(fd);
  }
  CopyTrialOptions o;
  o.source = src;
  o.dir = dir;
  const CopyTrial t = run_copy_trial(o);
  CHECK(t.bytes == (8u << 20));
  CHECK(t.seconds > 0);
  REQUIRE_FALSE(t.completions.empty());
  CHECK(t.completions.back().second == t.bytes);
  CHECK(t.request_bytes > 0);
  CHECK(t.request_bytes <= kChunkBytes);
  std::size_t entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    (void)e;
    ++entries;
  }
  CHECK(entries == 1);  // the source alone: the scratch file was unlinked
  // At most `bytes`, and never more than the source holds.
  o.bytes = 1 << 20;
  CHECK(run_copy_trial(o).bytes == (1u << 20));
  std::filesystem::remove_all(dir);
}
