// qcommit report: a self-contained HTML page (inline SVG, no scripts, no external files) with the
// latency-vs-time and rate-vs-time plots of a `qcommit merge --trace` CSV.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "cli/json.h"
#include "cli/options.h"

namespace qcommit::cli {

namespace {

inline constexpr int kPlotWidth = 900;
inline constexpr int kPlotHeight = 300;
inline constexpr int kMargin = 60;

struct Series {
  std::string label, color;
  std::vector<double> y;
};

std::string html_escape(const std::string& s) {
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

double nice_ceiling(double v) {
  if (v <= 0) return 1;
  const double p = std::pow(10.0, std::floor(std::log10(v)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (v <= m * p) return m * p;
  return 10 * p;
}

std::string svg_plot(const std::string& id, const std::string& title, const std::string& ylabel,
                     const std::vector<double>& t, const std::vector<Series>& series) {
  const double tmax = t.empty() ? 1 : std::max(1e-9, t.back());
  double ymax = 0;
  for (const auto& s : series)
    for (double v : s.y) ymax = std::max(ymax, v);
  ymax = nice_ceiling(ymax);
  const int w = kPlotWidth, h = kPlotHeight, m = kMargin;
  auto X = [&](double x) { return m + (w - 2 * m) * x / tmax; };
  auto Y = [&](double y) { return h - m + 10 - (h - m - 10) * y / ymax; };
  std::ostringstream o;
  o << "<svg id=\"" << id << "\" class=\"plot\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" << w
    << "\" height=\"" << h + 20 << "\" viewBox=\"0 0 " << w << ' ' << h + 20 << "\">\n";
  o << "<text x=\"" << w / 2 << "\" y=\"14\" text-anchor=\"middle\" font-weight=\"bold\">"
    << html_escape(title) << "</text>\n";
  // Axes and grid.
  for (int i = 0; i <= 5; ++i) {
    const double yv = ymax * i / 5, yy = Y(yv);
    o << "<line x1=\"" << m << "\" y1=\"" << yy << "\" x2=\"" << w - m << "\" y2=\"" << yy
      << "\" stroke=\"#ddd\"/><text x=\"" << m - 6 << "\" y=\"" << yy + 4
      << "\" text-anchor=\"end\" font-size=\"11\">" << yv << "</text>\n";
    const double xv = tmax * i / 5, xx = X(xv);
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f", xv);
    o << "<text x=\"" << xx << "\" y=\"" << h - m + 26
      << "\" text-anchor=\"middle\" font-size=\"11\">" << buf << "</text>\n";
  }
  o << "<line x1=\"" << m << "\" y1=\"" << Y(0) << "\" x2=\"" << w - m << "\" y2=\"" << Y(0)
    << "\" stroke=\"#000\"/>\n";
  o << "<line x1=\"" << m << "\" y1=\"" << Y(0) << "\" x2=\"" << m << "\" y2=\"" << Y(ymax)
    << "\" stroke=\"#000\"/>\n";
  o << "<text x=\"" << w / 2 << "\" y=\"" << h - m + 44
    << "\" text-anchor=\"middle\" font-size=\"12\">time (s)</text>\n";
  o << "<text x=\"14\" y=\"" << h / 2 << "\" transform=\"rotate(-90 14 " << h / 2
    << ")\" text-anchor=\"middle\" font-size=\"12\">" << html_escape(ylabel) << "</text>\n";
  int legend_y = 30;
  for (const auto& s : series) {
    o << "<polyline class=\"series\" fill=\"none\" stroke=\"" << s.color
      << "\" stroke-width=\"1.5\" points=\"";
    for (size_t i = 0; i < t.size() && i < s.y.size(); ++i) o << X(t[i]) << ',' << Y(s.y[i]) << ' ';
    o << "\"/>\n<rect x=\"" << w - m - 220 << "\" y=\"" << legend_y - 9
      << "\" width=\"12\" height=\"3\" fill=\"" << s.color << "\"/><text x=\"" << w - m - 202
      << "\" y=\"" << legend_y - 4 << "\" font-size=\"11\">" << html_escape(s.label) << "</text>\n";
    legend_y += 14;
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace

int cmd_report(const Args& args) {
  po::options_description opts("options");
  std::string trace, out_path, output = "human";
  opts.add_options()("trace", po::value(&trace)->required(),
                     "CSV written by qcommit merge --trace")("html,o", po::value(&out_path),
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
  std::ifstream in(trace);
  if (!in) throw std::runtime_error(trace + ": cannot open");
  std::string line;
  if (!std::getline(in, line)) throw std::runtime_error(trace + ": empty trace");
  std::map<std::string, size_t> col;
  {
    std::stringstream ss(line);
    std::string name;
    for (size_t i = 0; std::getline(ss, name, ','); ++i) col[name] = i;
  }
  for (const char* need :
       {"t_s", "fg_max_ms", "queue_delay_ms", "rate_bytes_per_s", "window_bytes", "bytes_done"})
    if (!col.count(need))
      throw std::runtime_error(trace + ": not a qcommit trace (no column '" + need + "')");
  std::vector<std::vector<double>> rows;
  size_t lineno = 1;
  while (std::getline(in, line)) {
    ++lineno;
    std::vector<double> r;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) {
      char* end = nullptr;
      double v = std::strtod(cell.c_str(), &end);
      r.push_back(end == cell.c_str() ? 0 : v);
    }
    if (r.size() < col.size())
      throw std::runtime_error(trace + ": line " + std::to_string(lineno) + " is short");
    rows.push_back(std::move(r));
  }
  auto column = [&](const char* name, double scale) {
    std::vector<double> v;
    for (auto& r : rows) v.push_back(r[col[name]] * scale);
    return v;
  };
  const auto t = column("t_s", 1);
  const auto fg = column("fg_max_ms", 1);
  const double mib = 1.0 / (1024 * 1024);
  std::vector<double> fg_sorted = fg;
  std::sort(fg_sorted.begin(), fg_sorted.end());
  auto pct = [&](double p) {
    return fg_sorted.empty() ? 0.0 : fg_sorted[size_t(p * double(fg_sorted.size() - 1))];
  };
  const double done = rows.empty() ? 0 : rows.back()[col["bytes_done"]];
  const double secs = t.empty() ? 0 : t.back();

  const double mean_rate = secs > 0 ? done / secs : 0;
  const double p50 = pct(0.5), p99 = pct(0.99), pmax = fg_sorted.empty() ? 0 : fg_sorted.back();

  if (!out_path.empty()) {
    std::ostringstream html;
    html << "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>qcommit merge "
            "report</title>\n"
         << "<style>body{font-family:sans-serif;margin:2em;color:#222} "
            "table{border-collapse:collapse}"
         << " td,th{border:1px solid #ccc;padding:4px 10px;text-align:right} "
            ".plot{display:block;margin:1em 0}</style>"
         << "</head><body>\n<h1>qcommit merge report</h1>\n<p>trace: " << html_escape(trace)
         << "</p>\n"
         << "<table><tr><th>duration</th><th>copied</th><th>mean rate</th><th>probe "
            "p50</th><th>probe p99</th>"
         << "<th>probe max</th></tr><tr>";
    char b[256];
    std::snprintf(b, sizeof b,
                  "<td>%.1f s</td><td>%.1f MiB</td><td>%.1f MiB/s</td><td>%.2f ms</td><td>%.2f "
                  "ms</td><td>%.2f ms</td>",
                  secs, done * mib, mean_rate * mib, p50, p99, pmax);
    html << b << "</tr></table>\n";
    html << svg_plot("latency", "Latency over time", "ms", t,
                     {{"probe / foreground max per tick", "#c0392b", fg},
                      {"queueing delay (controller)", "#2980b9", column("queue_delay_ms", 1)}});
    html << svg_plot("rate", "Rate and window over time", "MiB/s  |  MiB", t,
                     {{"pacing rate (MiB/s)", "#27ae60", column("rate_bytes_per_s", mib)},
                      {"window (MiB)", "#8e44ad", column("window_bytes", mib)}});
    html << "</body></html>\n";
    std::ofstream f(out_path, std::ios::trunc);
    f << html.str();
    f.close();
    if (!f) throw std::runtime_error(out_path + ": cannot write");
  }
  if (out == Output::kJson) {
    print_json(json::Ordered{
        {"trace", trace},
        {"html", out_path.empty() ? json::Ordered(nullptr) : json::Ordered(out_path)},
        {"rows", rows.size()},
        {"duration-seconds", rounded(secs, 3)},
        {"copied-bytes", whole(done)},
        {"mean-rate-bytes-per-second", whole(mean_rate)},
        {"probe-ms",
         {{"p50", rounded(p50, 3)}, {"p99", rounded(p99, 3)}, {"max", rounded(pmax, 3)}}}});
  } else {
    std::printf(
        "%s: %.1f s, %.1f MiB copied at %.1f MiB/s; probe p50 %.2f ms, p99 %.2f ms, max %.2f ms\n",
        trace.c_str(), secs, done * mib, mean_rate * mib, p50, p99, pmax);
    if (!out_path.empty()) std::printf("%s\n", out_path.c_str());
  }
  return kExitOk;
}

}  // namespace qcommit::cli
