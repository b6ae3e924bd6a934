// SPDX-License-Identifier: GPL-2.0-or-later
// The two traces, qcommit merge --trace (engine/budget_governor.cpp) and qcommitd --trace
// (plugin/daemon/trace_file.cpp), in one format (common/trace_csv.h): "# key=value" lines, one
// snake_case header naming the columns (time first, as t_s), rows of the header's width.
#include <doctest/doctest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "engine/budget_governor.h"
#include "plugin/daemon/trace_file.h"

using namespace qcommit::plugin;

namespace {

// A CSV line's fields: quoted fields with doubled quotes, as csv_field writes them.
std::vector<std::string> csv_fields(const std::string& line) {
  std::vector<std::string> out(1);
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted && c == '"' && i + 1 < line.size() && line[i + 1] == '"') {
      out.back() += '"';
      ++i;
    } else if (c == '"') {
      quoted = !quoted;
    } else if (c == ',' && !quoted) {
      out.emplace_back();
    } else {
      out.back() += c;
    }
  }
  return out;
}

struct ParsedTrace {
  std::vector<std::string> params;  // "key=value"
  std::vector<std::string> columns;
  std::vector<std::vector<std::string>> rows;
};

// Reads `path` as the trace format; CHECKs what a reader relies on.
ParsedTrace read_trace(const std::string& path) {
  static const std::regex kHeader("^[a-z][a-z0-9_]*(,[a-z][a-z0-9_]*)*$");
  static const std::regex kParam("^# [a-z][a-z0-9_]*=.*$");
  std::ifstream in(path);
  ParsedTrace t;
  std::string line, header;
  while (std::getline(in, line)) {
    INFO(path << ": line \"" << line << "\"");
    if (header.empty() && line.rfind("#", 0) == 0) {
      CHECK(std::regex_match(line, kParam));
      t.params.push_back(line.substr(2));
    } else if (header.empty()) {
      CHECK(std::regex_match(line, kHeader));
      header = line;
      t.columns = csv_fields(line);
    } else {
      CHECK(line != header);  // one header, however often the file was opened
      t.rows.push_back(csv_fields(line));
      CHECK(t.rows.back().size() == t.columns.size());
    }
  }
  return t;
}

bool has_column(const ParsedTrace& t, const std::string& name) {
  for (const auto& c : t.columns)
    if (c == name) return true;
  return false;
}

}  // namespace

TEST_CASE("plugin.trace.merge_and_daemon_share_the_format") {
  char dir[] = "/tmp/qcommit-trace-XXXXXX";
  REQUIRE(mkdtemp(dir));
  const std::string merge_path = std::string(dir) + "/merge.csv";
  const std::string daemon_path = std::string(dir) + "/daemon.csv";

  {  // the merge's: written from the governor's start to its end
    qcommit::engine::BudgetGovernorConfig cfg;
    cfg.trace_path = merge_path;
    cfg.trace_params = {{"top", "/v/top,1.qcow2"}, {"base", "/v/b\nase.qcow2"}};
    cfg.cotenant_thread = false;
    REQUIRE(cfg.validate() == "");
    qcommit::engine::BudgetGovernor gov(cfg);
  }
  GovernorStatus st;
  JobStatus j;
  j.domain = "vm,\"1\"\nnext";  // a name that would break an unquoted row
  j.disk = "vda";
  j.speed_bytes_per_s = 1 << 20;
  j.window_bytes = 4 << 20;
  j.phase = "steady";
  st.jobs.push_back(j);
  for (int opened = 0; opened < 2; ++opened) {  // qcommitd appends: a restart reopens the file
    TraceFile daemon(daemon_path);
    daemon.write(st, TimePoint{} + std::chrono::seconds(10 + opened));
  }

  const ParsedTrace merge = read_trace(merge_path);
  const ParsedTrace daemon = read_trace(daemon_path);
  REQUIRE(!merge.columns.empty());
  REQUIRE(!daemon.columns.empty());
  CHECK(merge.columns.front() == "t_s");
  CHECK(daemon.columns.front() == "t_s");
  for (const char* shared : {"window_bytes", "backlog_bytes"}) {
    INFO("column " << shared);
    CHECK(has_column(merge, shared));
    CHECK(has_column(daemon, shared));
  }
  CHECK(merge.rows.size() >= 1);
  REQUIRE(daemon.rows.size() == 2);
  CHECK(daemon.rows[0][1] == "vm,\"1\"\\nnext");
  CHECK(merge.params.at(2) == "top=/v/top,1.qcow2");
  CHECK(merge.params.at(3) == "base=/v/b\\nase.qcow2");
  std::remove(merge_path.c_str());
  std::remove(daemon_path.c_str());
  ::rmdir(dir);
}
