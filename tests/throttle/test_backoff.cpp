// SPDX-License-Identifier: GPL-2.0-or-later
// throttle::Backoff: the reconnect spacing qcommitd's governor and `qcommit live` share.
#include <doctest/doctest.h>

#include <chrono>
#include <vector>

#include "throttle/backoff.h"

using namespace qcommit::throttle;
using std::chrono::milliseconds;
using std::chrono::seconds;

namespace {
TimePoint at(milliseconds ms) {
  return TimePoint(ms);
}
}  // namespace

TEST_CASE("throttle.backoff.doubling_to_max") {
  Backoff b(milliseconds(500), seconds(5));
  CHECK(b.due(at(milliseconds(0))));  // the first attempt at once
  std::vector<long> gaps;
  TimePoint now = at(milliseconds(1000));
  for (int i = 0; i < 7; ++i) {
    REQUIRE(b.due(now));
    b.failed(now);
    CHECK_FALSE(b.due(b.next() - milliseconds(1)));
    gaps.push_back(long(std::chrono::duration_cast<milliseconds>(b.next() - now).count()));
    now = b.next();
  }
  CHECK(gaps == std::vector<long>{500, 1000, 2000, 4000, 5000, 5000, 5000});
}

TEST_CASE("throttle.backoff.success_starts_over") {
  Backoff b(milliseconds(500), seconds(5));
  TimePoint now = at(milliseconds(0));
  for (int i = 0; i < 4; ++i) {
    b.failed(now);
    now = b.next();
  }
  CHECK(b.next() == at(milliseconds(500 + 1000 + 2000 + 4000)));
  b.succeeded();
  // Lost again later: the first retry at once, then 500 ms, not the 5 s reached before.
  b.retry_now(at(seconds(60)));
  CHECK(b.due(at(seconds(60))));
  b.failed(at(seconds(60)));
  CHECK(b.next() == at(seconds(60) + milliseconds(500)));
}

TEST_CASE("throttle.backoff.loss_without_success_keeps_the_delay") {
  // The governor marks a loss again while still reconnecting (no success in between): the retry
  // is at once, and the spacing goes on from where it was.
  Backoff b(milliseconds(500), seconds(5));
  b.failed(at(milliseconds(0)));
  b.failed(at(milliseconds(500)));  // next at 1500, delay now 2 s
  b.retry_now(at(milliseconds(600)));
  CHECK(b.due(at(milliseconds(600))));
  b.failed(at(milliseconds(600)));
  CHECK(b.next() == at(milliseconds(2600)));
}
