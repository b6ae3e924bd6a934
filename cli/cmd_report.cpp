// SPDX-License-Identifier: GPL-2.0-or-later
// qcommit report: a self-contained HTML page (inline SVG, no scripts, no external files) with the
// plots of a `qcommit merge --trace` CSV: latency with the budget, pacing rate beside the
// achieved throughput, bytes done, and the window. The merge's parameters come from the trace's
// leading "# key=value" lines; a trace without them (older qcommit) says "not recorded".
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cli/json.h"
#include "cli/options.h"
#include "common/safe_file.h"
#include "qcow2/error.h"
#include "throttle/percentile.h"

namespace qcommit::cli {

namespace {

inline constexpr int kPlotWidth = 900;
inline constexpr int kPlotHeight = 300;
inline constexpr int kMargin = 60;
inline constexpr double kMiB = 1024.0 * 1024.0;
// The latency plot's axis reaches at least this multiple of the budget: the budget line lies
// below the plot's top, with room for its label.
inline constexpr double kBudgetHeadroom = 1.2;
// Achieved throughput at a row: bytes done over (about) the preceding half second.
inline constexpr double kThroughputWindowSeconds = 0.5;
inline constexpr const char* kNotRecorded = "not recorded";

struct Series {
  std::string id, label, color;
  std::vector<double> y;
};

// A horizontal line across a plot at `value` (the budget on the latency plot).
struct Reference {
  std::string id, label, color;
  double value;
};

std::string html_escape(std::string_view s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '&':
        o += "&amp;";
        break;
      case '"':
        o += "&quot;";
        break;
      default:
        o += c;
    }
  }
  return o;
}

// A number as the stream writes it (six significant digits).
std::string number(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

// SVG written element by element: every attribute value and every text is escaped here, so no
// caller splices markup into strings.
class Svg {
 public:
  struct Attr {
    Attr(const char* n, std::string_view v) : name(n), value(html_escape(v)) {}
    Attr(const char* n, double v) : name(n), value(number(v)) {}
    Attr(const char* n, int v) : name(n), value(std::to_string(v)) {}
    const char* name;
    std::string value;
  };
  using Attrs = std::initializer_list<Attr>;

  // <tag a="v" ...>
  Svg& open(const char* tag, Attrs attrs) {
    start(tag, attrs);
    o_ << '>';
    return *this;
  }
  // <tag a="v" .../>
  Svg& empty(const char* tag, Attrs attrs) {
    start(tag, attrs);
    o_ << "/>";
    return *this;
  }
  // <tag a="v" ...>text</tag>
  Svg& element(const char* tag, Attrs attrs, std::string_view text) {
    open(tag, attrs);
    o_ << html_escape(text);
    return close(tag);
  }
  Svg& close(const char* tag) {
    o_ << "</" << tag << '>';
    return *this;
  }
  Svg& newline() {
    o_ << '\n';
    return *this;
  }
  [[nodiscard]] std::string str() const { return o_.str(); }

 private:
  void start(const char* tag, Attrs attrs) {
    o_ << '<' << tag;
    for (const Attr& a : attrs) o_ << ' ' << a.name << "=\"" << a.value << '"';
  }
  std::ostringstream o_;
};

double nice_ceiling(double v) {
  if (v <= 0) return 1;
  const double p = std::pow(10.0, std::floor(std::log10(v)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (v <= m * p) return m * p;
  return 10 * p;
}

// The time axis's labels: multiples of a step of 1, 2 or 5 times a power of ten, at most
// kTimeTicks + 1 of them, each written with the decimals its step needs, so that no two read
// the same (a 0.25 s trace gave 0.0 0.1 0.1 0.2 0.2).
constexpr int kTimeTicks = 5;
struct TimeTicks {
  double step;
  int decimals;
};
TimeTicks time_ticks(double tmax) {
  const double step = nice_ceiling(tmax / kTimeTicks);
  return {step, std::max(0, -static_cast<int>(std::floor(std::log10(step) + 1e-9)))};
}

// A plot's frame: the title, the grid with the values at its lines, the axes and their labels.
struct PlotFrame {
  int w = kPlotWidth, h = kPlotHeight, m = kMargin;
  double tmax, ymax;
  [[nodiscard]] double x(double t) const { return m + (w - 2 * m) * t / tmax; }
  [[nodiscard]] double y(double v) const { return h - m + 10 - (h - m - 10) * v / ymax; }
};

void draw_frame(Svg& svg, const PlotFrame& f, const std::string& title, const std::string& ylabel) {
  const int w = f.w, h = f.h, m = f.m;
  svg.element("text", {{"x", w / 2}, {"y", 14}, {"text-anchor", "middle"}, {"font-weight", "bold"}},
              title)
      .newline();
  for (int i = 0; i <= 5; ++i) {
    const double yv = f.ymax * i / 5, yy = f.y(yv);
    svg.empty("line", {{"x1", m}, {"y1", yy}, {"x2", w - m}, {"y2", yy}, {"stroke", "#ddd"}})
        .element("text",
                 {{"class", "ytick"},
                  {"x", m - 6},
                  {"y", yy + 4},
                  {"text-anchor", "end"},
                  {"font-size", 11},
                  {"data-y", yy}},
                 number(yv))
        .newline();
  }
  const TimeTicks tt = time_ticks(f.tmax);
  for (int i = 0; i * tt.step <= f.tmax * (1 + 1e-9); ++i) {
    const double xv = i * tt.step;
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.*f", tt.decimals, xv);
    svg.element("text",
                {{"class", "xtick"},
                 {"x", f.x(xv)},
                 {"y", h - m + 26},
                 {"text-anchor", "middle"},
                 {"font-size", 11}},
                buf)
        .newline();
  }
  svg.empty("line", {{"x1", m}, {"y1", f.y(0)}, {"x2", w - m}, {"y2", f.y(0)}, {"stroke", "#000"}})
      .newline();
  svg.empty("line", {{"x1", m}, {"y1", f.y(0)}, {"x2", m}, {"y2", f.y(f.ymax)}, {"stroke", "#000"}})
      .newline();
  svg.element("text",
              {{"x", w / 2}, {"y", h - m + 44}, {"text-anchor", "middle"}, {"font-size", 12}},
              "time (s)")
      .newline();
  svg.element("text",
              {{"x", 14},
               {"y", h / 2},
               {"transform", "rotate(-90 14 " + std::to_string(h / 2) + ")"},
               {"text-anchor", "middle"},
               {"font-size", 12}},
              ylabel)
      .newline();
}

// Each series as a line, with its colour and label in the legend.
void draw_series(Svg& svg, const PlotFrame& f, const std::vector<double>& t,
                 const std::vector<Series>& series) {
  int legend_y = 30;
  for (const auto& s : series) {
    std::ostringstream points;
    for (size_t i = 0; i < t.size() && i < s.y.size(); ++i)
      points << f.x(t[i]) << ',' << f.y(s.y[i]) << ' ';
    svg.empty("polyline", {{"id", s.id},
                           {"class", "series"},
                           {"fill", "none"},
                           {"stroke", s.color},
                           {"stroke-width", "1.5"},
                           {"points", points.str()}})
        .newline();
    svg.empty("rect", {{"x", f.w - f.m - 220},
                       {"y", legend_y - 9},
                       {"width", 12},
                       {"height", 3},
                       {"fill", s.color}})
        .element("text", {{"x", f.w - f.m - 202}, {"y", legend_y - 4}, {"font-size", 11}}, s.label)
        .newline();
    legend_y += 14;
  }
}

// The reference as a dashed line across the plot, labelled at its right end.
void draw_reference(Svg& svg, const PlotFrame& f, const Reference& r) {
  const double yy = f.y(r.value);
  svg.empty("line", {{"id", r.id},
                     {"class", "reference"},
                     {"x1", f.m},
                     {"y1", yy},
                     {"x2", f.w - f.m},
                     {"y2", yy},
                     {"stroke", r.color},
                     {"stroke-width", 2},
                     {"stroke-dasharray", "6 4"}})
      .element("text",
               {{"x", f.w - f.m - 4},
                {"y", yy - 4},
                {"text-anchor", "end"},
                {"font-size", 11},
                {"fill", r.color}},
               r.label)
      .newline();
}

std::string svg_plot(const std::string& id, const std::string& title, const std::string& ylabel,
                     const std::vector<double>& t, const std::vector<Series>& series,
                     const std::optional<Reference>& reference = std::nullopt) {
  double ymax = reference ? reference->value * kBudgetHeadroom : 0;
  for (const auto& s : series)
    for (double v : s.y) ymax = std::max(ymax, v);
  const PlotFrame f{.tmax = t.empty() ? 1 : std::max(1e-9, t.back()), .ymax = nice_ceiling(ymax)};
  Svg svg;
  svg.open("svg", {{"id", id},
                   {"class", "plot"},
                   {"xmlns", "http://www.w3.org/2000/svg"},
                   {"width", f.w},
                   {"height", f.h + 20},
                   {"viewBox", "0 0 " + std::to_string(f.w) + " " + std::to_string(f.h + 20)}})
      .newline();
  draw_frame(svg, f, title, ylabel);
  draw_series(svg, f, t, series);
  if (reference) draw_reference(svg, f, *reference);
  svg.close("svg").newline();
  return svg.str();
}

// A `qcommit merge --trace` CSV: its columns by name and its rows of numbers.
struct Trace {
  std::map<std::string, std::string> params;  // the merge's, from "# key=value" lines
  std::map<std::string, size_t> col;
  std::vector<std::vector<double>> rows;

  // The parameter `key` as recorded, or kNotRecorded.
  [[nodiscard]] std::string param(const std::string& key) const {
    const auto it = params.find(key);
    return it == params.end() ? kNotRecorded : it->second;
  }

  // The column `name` of every row, times `scale`.
  [[nodiscard]] std::vector<double> column(const char* name, double scale) const {
    std::vector<double> v;
    const size_t c = col.at(name);
    for (const auto& r : rows) v.push_back(r[c] * scale);
    return v;
  }
};

// The header line: each column's index by name; refused unless it names what the report plots.
std::map<std::string, size_t> read_columns(const std::string& path, const std::string& line) {
  std::map<std::string, size_t> col;
  std::stringstream ss(line);
  std::string name;
  for (size_t i = 0; std::getline(ss, name, ','); ++i) col[name] = i;
  for (const char* need :
       {"t_s", "fg_max_ms", "queue_delay_ms", "rate_bytes_per_s", "window_bytes", "bytes_done"})
    if (!col.count(need))
      throw std::runtime_error(path + ": not a qcommit trace (no column '" + need + "')");
  return col;
}

// One data line's cells as numbers (0 where a cell is not one).
std::vector<double> read_row(const std::string& line) {
  std::vector<double> r;
  std::stringstream ss(line);
  std::string cell;
  while (std::getline(ss, cell, ',')) {
    char* end = nullptr;
    double v = std::strtod(cell.c_str(), &end);
    r.push_back(end == cell.c_str() ? 0 : v);
  }
  return r;
}

// A "# key=value" line's value with its escapes (\\, \n, \r) undone.
std::string unescape_param(std::string_view v) {
  std::string o;
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] != '\\' || i + 1 == v.size()) {
      o += v[i];
      continue;
    }
    const char c = v[++i];
    o += c == 'n' ? '\n' : c == 'r' ? '\r' : c;
  }
  return o;
}

// "# key=value" → params[key]; a comment line without '=' is skipped.
void read_param(const std::string& line, std::map<std::string, std::string>& params) {
  const size_t start = line.find_first_not_of("# ");
  const size_t eq = line.find('=');
  if (start == std::string::npos || eq == std::string::npos || eq <= start) return;
  params[line.substr(start, eq - start)] = unescape_param(std::string_view(line).substr(eq + 1));
}

Trace read_trace(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot open: " + std::strerror(errno));
  Trace t;
  std::string line;
  size_t lineno = 0;
  for (;;) {
    if (!std::getline(in, line)) throw std::runtime_error(path + ": empty trace");
    ++lineno;
    if (line.empty() || line[0] != '#') break;
    read_param(line, t.params);
  }
  t.col = read_columns(path, line);
  while (std::getline(in, line)) {
    ++lineno;
    std::vector<double> r = read_row(line);
    if (r.size() < t.col.size())
      throw std::runtime_error(path + ": line " + std::to_string(lineno) + " is short");
    t.rows.push_back(std::move(r));
  }
  return t;
}

// What the report's table and the printed summary say.
struct Summary {
  double seconds = 0, copied_bytes = 0, mean_rate = 0;
  double p50_ms = 0, p99_ms = 0, max_ms = 0;  // the probe's (foreground max per tick)
};

Summary summarize(const Trace& trace) {
  Summary s;
  const std::vector<double> t = trace.column("t_s", 1);
  const std::vector<double> fg = trace.column("fg_max_ms", 1);
  const auto pct = [&](unsigned percent) {
    return throttle::percentile(fg, percent).value_or(0.0);
  };
  s.copied_bytes = trace.rows.empty() ? 0 : trace.rows.back()[trace.col.at("bytes_done")];
  s.seconds = t.empty() ? 0 : t.back();
  s.mean_rate = s.seconds > 0 ? s.copied_bytes / s.seconds : 0;
  s.p50_ms = pct(50);
  s.p99_ms = pct(throttle::kP99Percent);
  s.max_ms = pct(throttle::kAllPercent);
  return s;
}

// The recorded budget in milliseconds, if the trace has it.
std::optional<double> budget_ms(const Trace& trace) {
  const auto it = trace.params.find("budget_ms");
  if (it == trace.params.end()) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(it->second.c_str(), &end);
  if (end == it->second.c_str() || !(v > 0)) return std::nullopt;
  return v;
}

// Achieved throughput at each row (bytes/s): the bytes done since the last row at least
// kThroughputWindowSeconds earlier (or since the merge's start, t = 0), over the time between.
std::vector<double> throughput(const std::vector<double>& t, const std::vector<double>& done) {
  std::vector<double> tt{0}, bb{0}, out;
  tt.insert(tt.end(), t.begin(), t.end());
  bb.insert(bb.end(), done.begin(), done.end());
  size_t j = 0;
  for (size_t i = 1; i < tt.size(); ++i) {
    while (j + 1 < i && tt[j + 1] <= tt[i] - kThroughputWindowSeconds) ++j;
    const double dt = tt[i] - tt[j];
    out.push_back(dt > 0 ? (bb[i] - bb[j]) / dt : 0);
  }
  return out;
}

// The page's head and style.
void write_head(std::ostringstream& html) {
  html << "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>qcommit merge "
          "report</title>\n"
       << "<style>body{font-family:sans-serif;margin:2em;color:#222} "
          "table{border-collapse:collapse;margin:0.5em 0}"
       << " td,th{border:1px solid #ccc;padding:4px 10px;text-align:right} "
          "#merge th,#merge td{text-align:left} .plot{display:block;margin:1em 0}</style>"
       << "</head><body>\n<h1>qcommit merge report</h1>\n";
}

// What was merged into what, under which budget, when and for how long.
void write_merge_header(std::ostringstream& html, const std::string& trace_path, const Trace& trace,
                        const Summary& s) {
  const std::optional<double> budget = budget_ms(trace);
  char duration[64];
  std::snprintf(duration, sizeof duration, "%.1f s", s.seconds);
  const std::pair<const char*, std::string> rows[] = {
      {"TOP", trace.param("top")},
      {"BASE", trace.param("base")},
      {"budget", budget ? number(*budget) + "ms" : kNotRecorded},
      {"start (UTC)", trace.param("start")},
      {"duration", duration},
      {"trace", trace_path}};
  html << "<table id=\"merge\">";
  for (const auto& [name, value] : rows)
    html << "<tr><th>" << name << "</th><td>" << html_escape(value) << "</td></tr>";
  html << "</table>\n";
}

// The totals: duration, bytes copied (the last row, the merge's end), mean rate, the probe.
void write_totals(std::ostringstream& html, const Summary& s) {
  html << "<table id=\"totals\"><tr><th>duration</th><th>copied</th><th>mean rate</th><th>probe "
          "p50</th><th>probe p99</th><th>probe max</th></tr><tr>";
  char b[320];
  std::snprintf(b, sizeof b,
                "<td>%.1f s</td><td id=\"copied\" data-bytes=\"%.0f\">%.1f MiB</td><td>%.1f "
                "MiB/s</td><td>%.2f ms</td><td>%.2f ms</td><td>%.2f ms</td>",
                s.seconds, s.copied_bytes, s.copied_bytes / kMiB, s.mean_rate / kMiB, s.p50_ms,
                s.p99_ms, s.max_ms);
  html << b << "</tr></table>\n";
}

// The plots: latency with the budget, pacing rate and achieved throughput, bytes done, window.
void write_plots(std::ostringstream& html, const Trace& trace) {
  const std::vector<double> t = trace.column("t_s", 1);
  const std::vector<double> done = trace.column("bytes_done", 1);
  std::optional<Reference> budget_line;
  if (const auto b = budget_ms(trace))
    budget_line = Reference{"budget-line", "budget " + number(*b) + "ms", "#e67e22", *b};
  html << svg_plot("latency", "Latency over time", "ms", t,
                   // the probe drawn last, over the queueing delay where both lie near zero
                   {{"series-queue-delay", "queueing delay (controller)", "#2980b9",
                     trace.column("queue_delay_ms", 1)},
                    {"series-probe", "probe / foreground max per tick", "#c0392b",
                     trace.column("fg_max_ms", 1)}},
                   budget_line);
  if (!budget_line) html << "<p id=\"no-budget\">budget: " << kNotRecorded << "</p>\n";
  std::vector<double> achieved = throughput(t, done);
  for (double& v : achieved) v /= kMiB;
  html << svg_plot(
      "rate", "Pacing rate and achieved throughput", "MiB/s", t,
      {{"series-pacing-rate", "pacing rate", "#27ae60", trace.column("rate_bytes_per_s", 1 / kMiB)},
       {"series-throughput", "achieved throughput (bytes done/s)", "#1f6fb2", achieved}});
  html << svg_plot(
      "done", "Bytes done", "MiB", t,
      {{"series-bytes-done", "bytes done", "#2c3e50", trace.column("bytes_done", 1 / kMiB)}});
  html << svg_plot(
      "window", "Window (bytes in flight allowed)", "MiB", t,
      {{"series-window", "window", "#8e44ad", trace.column("window_bytes", 1 / kMiB)}});
}

// The page: the merge's header, the totals, then the plots.
std::string report_html(const std::string& trace_path, const Trace& trace, const Summary& s) {
  std::ostringstream html;
  write_head(html);
  write_merge_header(html, trace_path, trace, s);
  write_totals(html, s);
  write_plots(html, trace);
  html << "</body></html>\n";
  return html.str();
}

// The report the user named: never through a symlink or into a FIFO, a device or someone else's
// file planted at that name (common/safe_file.h).
void write_file(const std::string& path, const std::string& text) {
  safe_file::Opened out = safe_file::open_output(path);
  if (!out.ok()) throw qcow2::IoError(path, out.problem, out.err);
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(out.fd.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw qcow2::IoError(path, std::string("cannot write: ") + std::strerror(errno), errno);
    done += size_t(n);
  }
}

void print_summary(const std::string& trace_path, const std::string& html_path, const Trace& trace,
                   const Summary& s, Output out) {
  if (out == Output::kJson) {
    const auto recorded = [&trace](const char* key) {
      const auto it = trace.params.find(key);
      return it == trace.params.end() ? json::Ordered(nullptr) : json::Ordered(it->second);
    };
    const std::optional<double> budget = budget_ms(trace);
    print_json(json::Ordered{
        {"trace", trace_path},
        {"html", html_path.empty() ? json::Ordered(nullptr) : json::Ordered(html_path)},
        {"rows", trace.rows.size()},
        {"top", recorded("top")},
        {"base", recorded("base")},
        {"budget-ms", budget ? json::Ordered(rounded(*budget, 3)) : json::Ordered(nullptr)},
        {"start", recorded("start")},
        {"duration-seconds", rounded(s.seconds, 3)},
        {"copied-bytes", whole(s.copied_bytes)},
        {"mean-rate-bytes-per-second", whole(s.mean_rate)},
        {"probe-ms",
         {{"p50", rounded(s.p50_ms, 3)},
          {"p99", rounded(s.p99_ms, 3)},
          {"max", rounded(s.max_ms, 3)}}}});
    return;
  }
  std::printf(
      "%s: %.1f s, %.1f MiB copied at %.1f MiB/s; probe p50 %.2f ms, p99 %.2f ms, max %.2f ms\n",
      trace_path.c_str(), s.seconds, s.copied_bytes / kMiB, s.mean_rate / kMiB, s.p50_ms, s.p99_ms,
      s.max_ms);
  if (!html_path.empty()) std::printf("%s\n", html_path.c_str());
}

}  // namespace

int cmd_report(const Args& args) {
  po::options_description opts("options");
  std::string trace_path, html_path, output = "human";
  opts.add_options()("trace", po::value(&trace_path)->required(),
                     "CSV written by qcommit merge --trace")("html,o", po::value(&html_path),
                                                             "the HTML file to write")(
      "output", po::value(&output), "human or json: the summary printed on stdout");
  po::positional_options_description pos;
  pos.add("trace", 1);
  po::variables_map vm;
  if (!parse(
          args, opts, pos, vm, "qcommit report TRACE.csv [-o REPORT.html] [--output=json]",
          "examples:\n  qcommit merge top.qcow2 --trace t.csv && qcommit report t.csv -o t.html\n"
          "  qcommit report t.csv --output=json | jq '.\"probe-ms\".p99'\n"))
    return kExitOk;
  if (output != "human" && output != "json")
    throw UsageError("--output is the summary's format, human or json, not '" + output +
                     "' (the HTML file is -o/--html FILE)");
  const Output out = parse_output(output);
  const Trace trace = read_trace(trace_path);
  const Summary s = summarize(trace);
  if (!html_path.empty()) write_file(html_path, report_html(trace_path, trace, s));
  print_summary(trace_path, html_path, trace, s, out);
  return kExitOk;
}

}  // namespace qcommit::cli
