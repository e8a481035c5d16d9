"""Plot an ``advantage-bench`` report: one horizontal bar chart per section, one bar per table row.

    advantage-bench --quick --plot bench.png                            # while benchmarking
    python -m advantage_server.bench.plot report.json bench.png         # from a saved ``--json`` report

Bars show the row's median time in ms (log scale) for the kernel, concurrency and end-to-end sections and
its extra memory in MiB for the memory section; rows without that number are left out. Needs matplotlib
(the ``demo`` extra).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from typing import Any

#: section -> (row field plotted, axis label, log scale)
MEASURES = {
    "memory": ("extra_mib", "extra memory (MiB)", False),
}
DEFAULT_MEASURE = ("ms", "median time (ms, log scale)", True)


def _rows(report: Any) -> list[dict[str, Any]]:
    data = dataclasses.asdict(report) if dataclasses.is_dataclass(report) else report
    return list(data.get("rows", []))


def plot_report(report: Any, path: str | pathlib.Path) -> int:
    """Write ``report`` (a ``Report`` or its ``--json`` dict) as a PNG at ``path``; returns the bars drawn."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'advantage-service[demo]'") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    sections: dict[str, list[tuple[str, float, str]]] = {}
    for row in _rows(report):
        key, _, _ = MEASURES.get(row["section"], DEFAULT_MEASURE)
        value = row.get(key)
        if value is None or value <= 0:
            continue
        label = f"{row['estimator']} {row['size']}  {row['impl']}"
        ours = str(row["impl"]).startswith("ours")
        sections.setdefault(row["section"], []).append((label[:70], float(value), "tab:blue" if ours else "tab:gray"))
    if not sections:
        raise SystemExit("the report has no rows to plot")
    heights = [max(1.2, 0.22 * len(bars) + 0.8) for bars in sections.values()]
    fig, axes = plt.subplots(len(sections), 1, figsize=(10, sum(heights)), dpi=100,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    drawn = 0
    for ax, (section, bars) in zip(axes[:, 0], sections.items()):
        _, xlabel, log = MEASURES.get(section, DEFAULT_MEASURE)
        labels, values, colors = zip(*bars)
        ax.barh(range(len(bars)), values, color=colors)
        ax.set_yticks(range(len(bars)), labels, fontsize=7)
        ax.invert_yaxis()
        if log:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_title(section, fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
        drawn += len(bars)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return drawn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m advantage_server.bench.plot", description=__doc__.splitlines()[0])
    ap.add_argument("report", help="JSON written by advantage-bench --json")
    ap.add_argument("png", help="PNG to write")
    args = ap.parse_args(argv)
    bars = plot_report(json.loads(pathlib.Path(args.report).read_text()), args.png)
    print(f"{bars} bars written to {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
