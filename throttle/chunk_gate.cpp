// SPDX-License-Identifier: GPL-2.0-or-later
#include "throttle/chunk_gate.h"

namespace qcommit::throttle {

std::optional<std::string> ChunkGateConfig::validate() const {
  if (chunk_bytes == 0) return "chunk_bytes must be > 0";
  if (open_hold <= Duration::zero()) return "open_hold must be > 0";
  return std::nullopt;
}

ChunkGate::ChunkGate(ChunkGateConfig cfg) : cfg_(cfg) {}

Duration ChunkGate::period(double rate_bytes_per_s) const {
  return std::chrono::duration_cast<Duration>(
      std::chrono::duration<double>(static_cast<double>(cfg_.chunk_bytes) / rate_bytes_per_s));
}

ChunkGate::Action ChunkGate::step(TimePoint now, double rate_bytes_per_s, bool allowed) {
  if (open_) {
    if (allowed && now - *opened_at_ < cfg_.open_hold) return Action::kNone;
    open_ = false;
    return Action::kClose;
  }
  if (!allowed || rate_bytes_per_s <= 0) return Action::kNone;
  if (opened_at_ && now - *opened_at_ < period(rate_bytes_per_s)) return Action::kNone;
  open_ = true;
  opened_at_ = now;  // a late opening is not made up for
  return Action::kOpen;
}

}  // namespace qcommit::throttle
