// SPDX-License-Identifier: GPL-2.0-or-later
// qcommit status: asks qcommitd (control socket) which block jobs it governs.

#include <cctype>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cli/commands.h"
#include "cli/daemon.h"
#include "cli/options.h"
#include "cli/units.h"
#include "common/defaults.h"
#include "plugin/host/json.h"

namespace qcommit::cli {
namespace {

// Member `key` of `o` printed with `fmt` (after dividing by `scale`), "-" when not a number.
std::string num_or_dash(const json::Value& o, const char* key, const char* fmt,
                        double scale = 1.0) {
  const json::Value* v = json::member(o, key);
  if (!v || !v->is_number()) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v->get<double>() / scale);
  return buf;
}

const std::string& str(const json::Value& o, const char* key) {
  return json::string_member(o, key);
}

// Member `key` of `o` is true.
bool is_true(const json::Value& o, const char* key) {
  const json::Value* v = json::member(o, key);
  return v && v->is_boolean() && v->get<bool>();
}

}  // namespace

namespace {

inline constexpr const char* kDefaultWatch = "1s";
inline constexpr std::chrono::milliseconds kMinWatch{100};
// A job that ended stays in the table, with how it ended, this long; older ends are listed below
// it, at most kEarlierEndsShown of them (the JSON has every end qcommitd remembers).
inline constexpr double kEndedInTableS = 60.0;
inline constexpr std::size_t kEarlierEndsShown = 5;
inline constexpr const char* kTableFormat =
    "%-16s %-5s %-13s %-12s %7s %11s %10s %8s %10s %8s  %-11s %s\n";

// How a released job ended, in words: qcommitd's "state" ("pivoted", "completed", "canceled",
// "failed", "pivot-failed"; "ended" when it saw the job gone without libvirt saying how).
std::string end_words(const json::Value& r) {
  const std::string& state = str(r, "state");
  if (state.empty()) return str(r, "reason");  // a qcommitd from before "state"
  if (state == "pivot-failed") return "pivot failed";
  if (state == "ended") return "ended (" + str(r, "reason") + ")";
  return state;
}

double age_of(const json::Value& r) {
  const json::Value* v = json::member(r, "age_s");
  return v && v->is_number() ? v->get<double>() : 0.0;
}

void print_header() {
  std::printf(kTableFormat, "DOMAIN", "DISK", "TYPE", "POOL", "BUDGET", "SPEED", "WINDOW", "P99",
              "LEFT", "ETA", "PROBE", "PHASE");
}

// The shared-queue probe in the table: "on" with the latency of the last probe, "off" (why: below
// the table), "local" (probe=auto on a filesystem no other host shares), "disabled" (probe=off);
// from a qcommitd before "probe", "on" when it has a period, else "-".
std::string probe_cell(const json::Value& j) {
  std::string state = str(j, "probe");
  if (state.empty())
    return json::member(j, "probe_period_ms") && json::member(j, "probe_period_ms")->is_number()
               ? "on"
               : "-";
  if (state != "on") return state;
  const std::string last = num_or_dash(j, "probe_last_ms", "%.1fms");
  return last == "-" ? state : state + " " + last;
}

void print_job_row(const json::Value& j) {
  std::string pool = str(j, "pool");
  if (pool.empty()) pool = "-";
  const std::string phase =
      str(j, "phase") + (str(j, "policy_error").empty() ? "" : " (" + str(j, "policy_error") + ")");
  std::printf(kTableFormat, str(j, "domain").c_str(), str(j, "disk").c_str(),
              str(j, "type").c_str(), pool.c_str(), num_or_dash(j, "budget_ms", "%.0fms").c_str(),
              num_or_dash(j, "speed_bytes_per_s", "%.1fMiB/s", 1048576.0).c_str(),
              num_or_dash(j, "window_bytes", "%.1fMiB", 1048576.0).c_str(),
              num_or_dash(j, "latency_p99_ms", "%.1fms").c_str(),
              num_or_dash(j, "bytes_left", "%.1fMiB", 1048576.0).c_str(),
              num_or_dash(j, "eta_s", "%.0fs").c_str(), probe_cell(j).c_str(), phase.c_str());
}

// How soon the job's first speed was seen in QEMU after it was found, and whether it was
// adopted late; nothing until then (or from a qcommitd before time to govern).
void print_governed_line(const json::Value& j) {
  const json::Value* t = json::member(j, "time_to_govern_ms");
  if (!t || !t->is_number()) return;  // not governed yet, or an older qcommitd
  std::string late;
  if (is_true(j, "late_adoption"))
    late = ", late adoption: " +
           num_or_dash(j, "copied_before_governed_bytes", "%.1fMiB", 1048576.0) +
           " copied unpaced";
  std::printf("governed: %s %s: %s after it was found (%s)%s\n", str(j, "domain").c_str(),
              str(j, "disk").c_str(), num_or_dash(j, "time_to_govern_ms", "%.1fms").c_str(),
              str(j, "found_by").c_str(), late.c_str());
}

// A mirror whose work left does not shrink (the guests write its disk faster than the budget lets
// it copy), and its converge floor once on; nothing for the others (or an older qcommitd).
void print_convergence_line(const json::Value& j) {
  const json::Value* c = json::member(j, "converging");
  const bool stalled = c && c->is_boolean() && !c->get<bool>();
  const json::Value* f = json::member(j, "converge_floor_bytes_per_s");
  const bool floor = f && f->is_number() && f->get<double>() > 0;
  if (!stalled && !floor) return;
  std::printf("converging: %s %s: %s; the guests add %s%s\n", str(j, "domain").c_str(),
              str(j, "disk").c_str(), stalled ? "no, its work left grows" : "yes",
              num_or_dash(j, "added_bytes_per_s", "%.1fMiB/s", 1048576.0).c_str(),
              floor ? ("; converge floor " +
                       num_or_dash(j, "converge_floor_bytes_per_s", "%.1fMiB/s", 1048576.0) +
                       " until ready, above the budget where need be")
                          .c_str()
                    : "");
}

// A job that escaped governance (its target far dirtier than its budget allows when qcommitd
// found it): how much, the storage time that stands for, whether it is still held at the floor,
// and the kernel's dirty limit on its storage; nothing for the others (or an older qcommitd).
void print_escape_line(const json::Value& j) {
  if (!is_true(j, "escaped")) return;
  const std::string limit =
      str(j, "bdi_limit").empty() ? "" : "; kernel dirty limit " + str(j, "bdi_limit");
  std::printf("escaped: %s %s: %s dirty, about %s of storage; %s%s\n", str(j, "domain").c_str(),
              str(j, "disk").c_str(), num_or_dash(j, "escaped_bytes", "%.1fMiB", 1048576.0).c_str(),
              num_or_dash(j, "escape_cost_s", "%.1fs").c_str(),
              is_true(j, "escape_held") ? "held at the floor" : "back within its window",
              limit.c_str());
}

// A job that ended lately: its row, with how it ended and when.
void print_ended_row(const json::Value& r) {
  char ago[32];
  std::snprintf(ago, sizeof ago, " %.0f s ago", age_of(r));
  std::printf(kTableFormat, str(r, "domain").c_str(), str(r, "disk").c_str(),
              str(r, "type").c_str(), "-", "-", "-", "-", "-", "-", "-", "-",
              (end_words(r) + ago).c_str());
}

// One request line to qcommitd, one response line back; nullopt after printing why not.
std::optional<std::string> ask(const std::string& socket_path, const std::string& request) {
  std::string error;
  std::optional<std::string> line = ask_qcommitd(socket_path, request, error);
  if (!line) std::fprintf(stderr, "qcommit status: %s\n", error.c_str());
  return line;
}

// The libvirt hook's message: DOMAIN is data (any bytes), EVENT one of the hook's operations.
int send_domain_event(const std::string& socket_path, const std::string& domain,
                      const std::string& event) {
  const std::optional<std::string> line =
      ask(socket_path,
          json::dump(json::Ordered{{"cmd", "domain-event"}, {"domain", domain}, {"event", event}}));
  if (!line) return kExitError;
  std::optional<json::Value> v = json::parse(*line, json::kControlResponseLimits, nullptr);
  if (!v || !is_true(*v, "ok")) {
    const std::string e = v ? str(*v, "error") : std::string();
    std::fprintf(stderr, "qcommit status: qcommitd refused the domain event: %s\n",
                 e.empty() ? "bad response" : e.c_str());
    return kExitError;
  }
  return kExitOk;
}

int status_once(const std::string& socket_path, bool json_out) {
  const std::optional<std::string> got =
      ask(socket_path, json::dump(json::Ordered{{"cmd", "status"}}));
  if (!got) return kExitError;
  const std::string& line = *got;
  std::string err;
  std::optional<json::Value> v = json::parse(line, json::kControlResponseLimits, &err);
  if (!v || !v->is_object()) {
    std::fprintf(stderr, "qcommit status: %s: bad response from qcommitd: %s\n",
                 socket_path.c_str(), err.c_str());
    return kExitError;
  }
  if (!is_true(*v, "ok")) {
    std::fprintf(stderr, "qcommit status: qcommitd: %s\n", str(*v, "error").c_str());
    return kExitError;
  }
  if (json_out) {
    std::printf("%s\n", line.c_str());
    return kExitOk;
  }
  std::printf("libvirt: %s\n", is_true(*v, "connected") ? "connected" : "NOT connected");
  static const json::Value kNone = json::Value::array();
  const json::Value* jobs = json::member(*v, "jobs");
  if (!jobs || !jobs->is_array()) jobs = &kNone;
  const json::Value* rel = json::member(*v, "released");
  if (!rel || !rel->is_array()) rel = &kNone;
  std::vector<const json::Value*> recent, earlier;  // newest first, as qcommitd lists them
  for (const auto& r : *rel) (age_of(r) <= kEndedInTableS ? recent : earlier).push_back(&r);
  if (jobs->empty() && recent.empty()) {
    std::printf("no governed block jobs\n");
  } else {
    print_header();
    for (const auto& j : *jobs) print_job_row(j);
    for (const json::Value* r : recent) print_ended_row(*r);
    for (const auto& j : *jobs)
      if (str(j, "probe") == "off")
        std::printf("probe off: %s %s: %s\n", str(j, "domain").c_str(), str(j, "disk").c_str(),
                    str(j, "probe_off_reason").c_str());
    for (const auto& j : *jobs) print_governed_line(j);
    for (const auto& j : *jobs) print_escape_line(j);
    for (const auto& j : *jobs) print_convergence_line(j);
    for (const auto& j : *jobs)  // "on", or "off: why"; absent where the filter does not apply
      if (!str(j, "target_throttle").empty())
        std::printf("throttle filter: %s %s: %s\n", str(j, "domain").c_str(),
                    str(j, "disk").c_str(), str(j, "target_throttle").c_str());
    for (const auto& j : *jobs)  // absent where no floor applies
      if (!str(j, "floor").empty())
        std::printf("floor: %s %s: %s\n", str(j, "domain").c_str(), str(j, "disk").c_str(),
                    str(j, "floor").c_str());
  }
  for (std::size_t i = 0; i < earlier.size() && i < kEarlierEndsShown; ++i)
    std::printf("earlier: %s %s (%s) %s, %.0f s ago\n", str(*earlier[i], "domain").c_str(),
                str(*earlier[i], "disk").c_str(), str(*earlier[i], "type").c_str(),
                end_words(*earlier[i]).c_str(), age_of(*earlier[i]));
  return kExitOk;
}

}  // namespace

namespace {

struct StatusArgs {
  std::string socket = defaults::kSocketPath;
  bool json_out = false;
  std::optional<std::chrono::nanoseconds> watch;  // redraw interval
  std::optional<std::pair<std::string, std::string>> domain_event;
};

constexpr const char* kStatusSynopsis =
    "qcommit status [--output=json] [--socket PATH] [--watch [INTERVAL]]\n"
    "       qcommit status [--socket PATH] --domain-event DOMAIN EVENT";
const std::string kStatusHelp =
    std::string("block jobs governed by qcommitd (default socket ") + defaults::kSocketPath +
    ")\n"
    "--watch: redraw every INTERVAL (a duration: 1s by default, at least 100ms) until interrupted\n"
    "--domain-event: tell qcommitd that DOMAIN started/stopped/reconnect/release\n"
    "  (what the libvirt hook does; qcommitd then looks at that domain at once)\n"
    "examples:\n  qcommit status\n  qcommit status --watch 500ms\n  qcommit status --output=json | "
    "jq .\n";

// The words Program_options cannot take as they come: --domain-event's two arguments are taken
// verbatim (a domain name may start with '-'), and --watch's optional INTERVAL is the next word
// when that starts with a digit.
Args take_verbatim_words(const Args& in, StatusArgs& out) {
  Args rest;
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] == "--domain-event") {
      if (i + 2 >= in.size()) throw UsageError("--domain-event needs DOMAIN and EVENT");
      out.domain_event = std::make_pair(in[i + 1], in[i + 2]);
      i += 2;
    } else if (in[i] == "--watch" && i + 1 < in.size() &&
               std::isdigit(static_cast<unsigned char>(in[i + 1][0]))) {
      rest.push_back("--watch=" + in[++i]);
    } else {
      rest.push_back(in[i]);
    }
  }
  return rest;
}

// Returns nullopt after printing --help.
std::optional<StatusArgs> parse_status_args(const Args& args) {
  StatusArgs sa;
  const Args rest = take_verbatim_words(args, sa);
  std::string output = "human", watch;
  po::options_description opts("options");
  opts.add_options()("output", po::value(&output), "human or json")("socket", po::value(&sa.socket),
                                                                    "qcommitd's control socket")(
      "watch", po::value(&watch)->implicit_value(kDefaultWatch), "redraw every INTERVAL");
  po::positional_options_description pos;
  po::variables_map vm;
  if (!parse(rest, opts, pos, vm, kStatusSynopsis, kStatusHelp.c_str())) return std::nullopt;
  sa.json_out = parse_output(output) == Output::kJson;
  if (vm.count("watch")) {
    sa.watch = parse_duration(watch, "--watch");
    if (*sa.watch < kMinWatch) throw UsageError("--watch interval must be at least 100ms");
  }
  return sa;
}

}  // namespace

int cmd_status(const Args& args) {
  const std::optional<StatusArgs> sa = parse_status_args(args);
  if (!sa) return kExitOk;
  if (sa->domain_event)
    return send_domain_event(sa->socket, sa->domain_event->first, sa->domain_event->second);
  if (!sa->watch) return status_once(sa->socket, sa->json_out);
  for (;;) {
    if (!sa->json_out) std::fputs("\033[H\033[2J", stdout);  // home + clear: a live view
    const int rc = status_once(sa->socket, sa->json_out);
    std::fflush(stdout);
    if (rc != kExitOk) return rc;
    if (std::ferror(stdout))
      return kExitOk;  // the reader went away (`| head`): nothing to draw for
    std::this_thread::sleep_for(*sa->watch);
  }
}

}  // namespace qcommit::cli
