#!/usr/bin/env python3
# SPDX-License-Identifier: GPL-2.0-or-later
"""Checks the DOM of a rendered qcommit report (chromium --dump-dom), stdlib only.
usage: check_dom.py DOM.html new TOP BASE BUDGET_MS BYTES   a trace with the merge's parameters
       check_dom.py DOM.html old BYTES                      a trace without them (older qcommit)
Prints one line per failed check on stderr and exits 1 if any failed."""
import re
import sys
from html.parser import HTMLParser

PLOTS = ["latency", "rate", "done", "window"]
SERIES = ["series-queue-delay", "series-probe", "series-pacing-rate", "series-throughput",
          "series-bytes-done", "series-window"]
Y_TOLERANCE_PX = 0.5


class Dom(HTMLParser):
    """Elements in document order: their attributes, the svg plot they are in, their text."""

    def __init__(self):
        super().__init__()
        self.elements, self.plot = [], None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg" and a.get("class") == "plot":
            self.plot = a.get("id")
        a["_tag"], a["_plot"], a["_text"] = tag, self.plot, ""
        self.elements.append(a)

    def handle_endtag(self, tag):
        if tag == "svg":
            self.plot = None

    def handle_data(self, data):
        if self.elements:
            self.elements[-1]["_text"] += data


def by_id(dom, ident):
    return [e for e in dom.elements if e.get("id") == ident]


def check_common(dom, errors, expected_bytes):
    plots = [e["id"] for e in dom.elements if e["_tag"] == "svg" and e.get("class") == "plot"]
    if plots != PLOTS:
        errors.append(f"plots {plots}, expected {PLOTS}")
    series = [e.get("id") for e in dom.elements if e["_tag"] == "polyline" and e.get("class") == "series"]
    if series != SERIES:
        errors.append(f"series {series}, expected {SERIES}")
    for e in dom.elements:
        if e["_tag"] == "polyline" and len(e.get("points", "").split()) < 2:
            errors.append(f"series {e.get('id')} has fewer than 2 points")
    window = by_id(dom, "series-window")
    if not window or window[0]["_plot"] != "window":
        errors.append("the window series is not on the window plot")
    rate_plot = {e.get("id") for e in dom.elements if e["_plot"] == "rate" and e["_tag"] == "polyline"}
    if rate_plot != {"series-pacing-rate", "series-throughput"}:
        errors.append(f"the rate plot holds {sorted(rate_plot)}, expected pacing rate and throughput")
    throughput = by_id(dom, "series-throughput")
    if throughput:
        ys = [float(p.split(",")[1]) for p in throughput[0]["points"].split()]
        if min(ys) == max(ys):
            errors.append("the throughput series is flat (no bytes done per second)")
    copied = by_id(dom, "copied")
    if not copied or int(copied[0].get("data-bytes", "-1")) != expected_bytes:
        got = copied[0].get("data-bytes") if copied else None
        errors.append(f"totals: copied {got} bytes, expected {expected_bytes}")
    elif f"{expected_bytes / 2**20:.1f} MiB" not in copied[0]["_text"]:
        errors.append(f"totals: copied cell says '{copied[0]['_text']}'")


def merge_rows(dom):
    """The header table (#merge) as {name: value}."""
    rows, inside, name = {}, False, None
    for e in dom.elements:
        if e["_tag"] == "table":
            inside = e.get("id") == "merge"
        elif inside and e["_tag"] == "th":
            name = e["_text"]
        elif inside and e["_tag"] == "td" and name:
            rows[name] = e["_text"]
    return rows


def budget_line_y(dom, budget_ms, errors):
    """The budget line's y against the y the latency plot's own axis gives the budget."""
    line = by_id(dom, "budget-line")
    if not line:
        errors.append("no budget line (#budget-line)")
        return
    line = line[0]
    if line["_plot"] != "latency":
        errors.append(f"the budget line is on plot {line['_plot']}, not on the latency plot")
    ticks = [(float(e["_text"]), float(e["data-y"])) for e in dom.elements
             if e["_plot"] == "latency" and e.get("class") == "ytick"]
    if len(ticks) < 2:
        errors.append("the latency plot has no y axis ticks")
        return
    (v0, y0), (v1, y1) = ticks[0], ticks[-1]
    expected = y0 + (budget_ms - v0) * (y1 - y0) / (v1 - v0)
    got1, got2 = float(line["y1"]), float(line["y2"])
    print(f"budget line at y={got1:.1f}, the axis puts {budget_ms} ms at y={expected:.1f}")
    if abs(got1 - expected) > Y_TOLERANCE_PX or abs(got2 - expected) > Y_TOLERANCE_PX:
        errors.append(f"budget line at y={got1}/{got2}, the axis puts {budget_ms} ms at {expected:.1f}")
    if not (min(y0, y1) <= expected <= max(y0, y1)):
        errors.append("the budget lies outside the latency plot's axis")


def check_new(dom, errors, top, base, budget_ms):
    rows = merge_rows(dom)
    for name, want in (("TOP", top), ("BASE", base), ("budget", f"{budget_ms}ms")):
        if not rows.get(name, "").endswith(want):
            errors.append(f"header {name} is '{rows.get(name)}', expected it to name {want}")
    if not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", rows.get("start (UTC)", "")):
        errors.append(f"header start is '{rows.get('start (UTC)')}', not a UTC time")
    if not re.fullmatch(r"\d+\.\d s", rows.get("duration", "")):
        errors.append(f"header duration is '{rows.get('duration')}'")
    budget_line_y(dom, float(budget_ms), errors)


def check_old(dom, errors):
    rows = merge_rows(dom)
    for name in ("TOP", "BASE", "budget", "start (UTC)"):
        if rows.get(name) != "not recorded":
            errors.append(f"old trace: header {name} is '{rows.get(name)}', expected 'not recorded'")
    if by_id(dom, "budget-line"):
        errors.append("old trace: a budget line without a recorded budget")


def main():
    dom = Dom()
    dom.feed(open(sys.argv[1], encoding="utf-8").read())
    errors = []
    if sys.argv[2] == "new":
        top, base, budget_ms, expected_bytes = sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6])
        check_new(dom, errors, top, base, budget_ms)
    else:
        expected_bytes = int(sys.argv[3])
        check_old(dom, errors)
    check_common(dom, errors, expected_bytes)
    for e in errors:
        print(f"{sys.argv[1]} ({sys.argv[2]}): {e}", file=sys.stderr)
    sys.exit(1 if errors else 0)


main()
