#!/usr/bin/env python3
"""Turns the JSON lines of the cuda_permute_grid bench into the summary
table (Markdown, stdout), a per-shape table (--table FILE) and a heat map
(--svg FILE) of each op's ratio to a device-to-device copy.

    python3 scripts/permute-grid.py permute-grid.json \
        --table docs/data/permute-grid.md --svg docs/img/permute-grid.svg

Standard library only: the SVG is written by hand, one rectangle per cell.
"""

import argparse
import json
import statistics
import sys
from collections import defaultdict

GOAL = 0.85
OPS = ["permute", "unpermute", "unpermute_backward", "sort_chunks_by_map", "memset (writes)"]


def load(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{n}: not JSON: {e}")
    if not rows:
        sys.exit(f"{path}: no measurements")
    return rows


def shape(r):
    return f"({r['t']},{r['e']},{r['h']},{r['topk']})"


def summary(rows):
    groups = defaultdict(list)
    for r in rows:
        groups[(r["dtype"], r["variant"], r["op"])].append(r)
    out = [
        f"| dtype | variant | op | shapes | min | median | >= {GOAL} | lowest at (T,E,H,topK) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = {op: i for i, op in enumerate(OPS)}
    for key in sorted(groups, key=lambda k: (k[0], k[1] != "plain", k[1], order.get(k[2], 9))):
        g = groups[key]
        ratios = [r["ratio"] for r in g]
        low = min(g, key=lambda r: r["ratio"])
        ok = sum(x >= GOAL for x in ratios)
        out.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {len(g)} | {min(ratios):.3f} | "
            f"{statistics.median(ratios):.3f} | {ok}/{len(g)} | {shape(low)} |"
        )
    return "\n".join(out)


def full_table(rows):
    out = [
        "| dtype | variant | (T,E,H,topK) | op | op us | copy us | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['dtype']} | {r['variant']} | {shape(r)} | {r['op']} | "
            f"{r['op_us']:.1f} | {r['copy_us']:.1f} | {r['ratio']:.3f} |"
        )
    return "\n".join(out)


def color(x):
    """Red below 0.70, through yellow at the goal, to green at 1.0."""
    lo, mid, hi = 0.70, GOAL, 1.0
    x = max(lo, min(hi, x))
    if x < mid:
        f = (x - lo) / (mid - lo)
        r, g = 215, int(48 + f * (200 - 48))
    else:
        f = (x - mid) / (hi - mid)
        r, g = int(215 - f * (215 - 40)), int(200 - f * (200 - 160))
    return f"rgb({r},{g},60)"


def heat_map(rows, device):
    """One panel per (dtype, variant, op): rows (E, topK), columns (T, H)."""
    panels = defaultdict(dict)
    for r in rows:
        panels[(r["dtype"], r["variant"], r["op"])][(r["e"], r["topk"], r["t"], r["h"])] = r["ratio"]
    order = {op: i for i, op in enumerate(OPS)}
    keys = sorted(panels, key=lambda k: (k[0] != "bf16", k[0], k[1] != "plain", k[1], order.get(k[2], 9)))
    cell, left, top, gap = 26, 70, 46, 40
    cols = sorted({(k[2], k[3]) for p in panels.values() for k in p})
    ylab = sorted({(k[0], k[1]) for p in panels.values() for k in p})
    pw, ph = left + cell * len(cols), top + cell * len(ylab) + 28
    per_row = 3
    width = per_row * (pw + gap)
    height = ((len(keys) + per_row - 1) // per_row) * (ph + gap) + 60
    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="10">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="10" y="18" font-size="13">Ratio to a device-to-device copy, graph replays, {device}; '
        f"rows (E, topK), columns (T, H); goal {GOAL}</text>",
    ]
    for i, key in enumerate(keys):
        ox = (i % per_row) * (pw + gap) + 10
        oy = (i // per_row) * (ph + gap) + 34
        svg.append(f'<text x="{ox}" y="{oy + 14}" font-size="12">{key[0]} {key[1]} {key[2]}</text>')
        for c, (t, h) in enumerate(cols):
            x = ox + left + c * cell
            svg.append(
                f'<text x="{x + cell / 2}" y="{oy + top - 4}" text-anchor="middle" font-size="8">'
                f"{t // 1024}k/{h}</text>"
            )
        for rr, (e, k) in enumerate(ylab):
            y = oy + top + rr * cell
            svg.append(f'<text x="{ox + left - 4}" y="{y + cell / 2 + 3}" text-anchor="end">E{e} k{k}</text>')
            for c, (t, h) in enumerate(cols):
                v = panels[key].get((e, k, t, h))
                if v is None:
                    continue
                x = ox + left + c * cell
                svg.append(f'<rect x="{x}" y="{y}" width="{cell - 1}" height="{cell - 1}" fill="{color(v)}"/>')
                svg.append(
                    f'<text x="{x + cell / 2}" y="{y + cell / 2 + 3}" text-anchor="middle" font-size="7">'
                    f"{v:.2f}</text>"
                )
    svg.append("</svg>")
    return "\n".join(svg)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json")
    ap.add_argument("--table", help="write the per-shape table (Markdown) here")
    ap.add_argument("--svg", help="write the heat map here")
    a = ap.parse_args()
    rows = load(a.json)
    print(summary(rows))
    if a.table:
        with open(a.table, "w") as f:
            f.write(
                "# The permute grid, shape by shape\n\n"
                "Generated by `scripts/permute-grid.py` from the JSON of the\n"
                "`cuda_permute_grid` bench (see docs/BENCHMARKS.md for the run).\n\n"
            )
            f.write(f"Device: {rows[0]['device']}.\n\n")
            f.write(full_table(rows) + "\n")
    if a.svg:
        with open(a.svg, "w") as f:
            f.write(heat_map(rows, rows[0]["device"]) + "\n")


if __name__ == "__main__":
    main()
