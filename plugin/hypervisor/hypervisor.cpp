// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/hypervisor/hypervisor.h"

namespace qcommit::plugin {

const char* to_string(JobType t) {
  switch (t) {
    case JobType::Pull:
      return "pull";
    case JobType::Copy:
      return "copy";
    case JobType::Commit:
      return "commit";
    case JobType::ActiveCommit:
      return "active-commit";
    case JobType::Backup:
      return "backup";
    case JobType::Unknown:
      break;
  }
  return "unknown";
}

const char* to_string(JobEventKind k) {
  switch (k) {
    case JobEventKind::StatusChange:
      return "status-change";
    case JobEventKind::Completed:
      return "completed";
    case JobEventKind::Failed:
      return "failed";
    case JobEventKind::Canceled:
      return "canceled";
    case JobEventKind::Ready:
      return "ready";
  }
  return "unknown";
}

}  // namespace qcommit::plugin
