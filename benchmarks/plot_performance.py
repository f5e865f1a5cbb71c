"""Draw docs/performance.png from the benchmarks' JSON files.

    python benchmarks/bench_encode.py  --json bench-out/encode.json
    python benchmarks/bench_device.py  --json bench-out/device.json
    python benchmarks/bench_handoff.py --json bench-out/handoff.json
    python benchmarks/plot_performance.py bench-out docs/performance.png

One panel per benchmark: each line is a speed-up (baseline time / ours, measured in the same
run, median) against the number of requests, with its interquartile range shaded where the
benchmark recorded it, and each target as a dotted line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

Series = dict[str, list[tuple[int, float, float | None, float | None]]]


def encode_series(doc: dict[str, Any]) -> tuple[Series, dict[str, float]]:
    series: Series = {}
    for row in doc["results"]:
        for op in ("encode", "decode"):
            ratio = (row.get(op) or {}).get("ratio_pickle_over_arrow", {}).get("c")
            if ratio:
                label = f"{op}, {row['workload']}"
                series.setdefault(label, []).append(
                    (row["n"], ratio["ratio"], ratio.get("q1"), ratio.get("q3"))
                )
    return series, {"encode target (1024)": 2.0, "decode target": 1.0}


def device_series(doc: dict[str, Any]) -> tuple[Series, dict[str, float]]:
    series: Series = {}
    for row in doc["whole_step"]:
        ratio = row["ratios"]["x_step"]
        series.setdefault(f"whole step, {row['workload']}", []).append(
            (row["requests"], ratio["ratio"], ratio.get("q1"), ratio.get("q3"))
        )
    return series, {"target, decode (1024)": 10.0, "target, wide rows (1024)": 5.0}


def handoff_series(doc: dict[str, Any]) -> tuple[Series, dict[str, float]]:
    series: Series = {}
    for n, row in sorted(doc["sizes"].items(), key=lambda kv: int(kv[0])):
        for cfg in ("columnar", "objects"):
            r = row[cfg]
            series.setdefault(f"{cfg} consumer", []).append(
                (int(n), r["ratio"], r.get("ratio_q1"), r.get("ratio_q3"))
            )
    return series, {"target, columnar (1024)": 4.0, "target, objects (1024)": 2.0}


PANELS = {
    "encode.json": ("Record-batch codec vs pickle protocol 5", encode_series),
    "device.json": ("Staged tensors to a batch vs vLLM's get_output()", device_series),
    "handoff.json": ("Process-to-process handoff vs vLLM's shm_broadcast", handoff_series),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="directory of the benchmarks' JSON files")
    parser.add_argument("out", type=Path, help="the PNG to write")
    args = parser.parse_args()
    found = [(name, *PANELS[name]) for name in PANELS if (args.results / name).exists()]
    if not found:
        raise SystemExit(f"no benchmark JSON in {args.results} (expected {', '.join(PANELS)})")
    fig, axes = plt.subplots(1, len(found), figsize=(5.2 * len(found), 4.2), squeeze=False)
    for ax, (name, title, extract) in zip(axes[0], found, strict=True):
        series, targets = extract(json.loads((args.results / name).read_text()))
        for label, points in series.items():
            points.sort()
            xs = [p[0] for p in points]
            ax.plot(xs, [p[1] for p in points], marker="o", label=label)
            if all(p[2] is not None and p[3] is not None for p in points):
                ax.fill_between(xs, [p[2] for p in points], [p[3] for p in points], alpha=0.15)
        for i, (label, value) in enumerate(targets.items()):
            ax.axhline(value, linestyle=":", color=f"C{7 + i % 3}", label=label)
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("requests per step")
        ax.set_ylabel("speed-up (x, higher is faster)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
