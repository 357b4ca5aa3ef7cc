"""PNG charts of benchmark rows (matplotlib, Agg backend), written next to the results files.

One call per scenario: ``save(stem, scenario, rows, title)`` picks the chart
the scenario registered in ``CHARTS`` (a new scenario adds its entry, or
calls ``grouped_bars`` / ``series_chart`` itself with its own keys) and
writes ``<stem>-<scenario>.png``.  Rows are the scenario's result dicts as
they go into the JSON; a row with an ``error`` key (a mode that failed) is
drawn as a labelled gap, never as a zero.  Charts show medians over
``--repeat`` with min-max whiskers.  Nothing here measures or touches the
testbed: without matplotlib ``available()`` is False and the caller prints
a note instead.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

MiB = 1 << 20
LOG_SCALE_RANGE = 20.0  # largest / smallest positive value above this: a log axis, so small bars stay visible
FIG_WIDTH_PER_GROUP_IN = 1.4
FIG_HEIGHT_IN = 4.8
DPI = 110


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a benchmark host
    import matplotlib.pyplot as plt

    return plt


def _stats(values: list[float]) -> tuple[float, float, float] | None:
    """(median, min, max) of the finite values; None when there are none."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return (statistics.median(vals), min(vals), max(vals)) if vals else None


def _wants_log(values: list[float]) -> bool:
    pos = [v for v in values if v > 0]
    return len(pos) > 1 and max(pos) / min(pos) > LOG_SCALE_RANGE


def grouped_bars(path: str, title: str, rows: list[dict], *, label_key: str = "mode",
                 value_keys: dict[str, str] | None = None, unit: str = "s", scale: float = 1.0) -> str:
    """One group of bars per distinct ``row[label_key]`` (in first-seen order), one bar per ``value_keys`` entry.

    ``value_keys``: row key -> legend label (default close-return and
    durable seconds).  Values are divided by ``scale`` (e.g. ``MiB``) and
    labelled with ``unit``.  Returns ``path``.
    """
    value_keys = value_keys or {"close_s": "close-return (slowest writer)", "durable_s": "durable (all in S3)"}
    labels = list(dict.fromkeys(str(r[label_key]) for r in rows))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, FIG_WIDTH_PER_GROUP_IN * len(labels) + 2), FIG_HEIGHT_IN))
    width = 0.8 / len(value_keys)
    stats = {(lab, k): _stats([r.get(k) / scale if r.get(k) is not None else None
                               for r in rows if str(r[label_key]) == lab and "error" not in r])
             for lab in labels for k in value_keys}
    log = _wants_log([s[0] for s in stats.values() if s])
    for j, (key, legend) in enumerate(value_keys.items()):
        xs = [i + (j - (len(value_keys) - 1) / 2) * width for i in range(len(labels))]
        st = [stats[(lab, key)] or (0.0, 0.0, 0.0) for lab in labels]  # no measurement: no bar
        heights = [s[0] for s in st]
        whiskers = [[s[0] - s[1] for s in st], [s[2] - s[0] for s in st]]
        ax.bar(xs, heights, width, label=legend, yerr=whiskers if any(map(any, whiskers)) else None, capsize=3)
        for x, v in zip(xs, heights):
            if v:
                ax.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                            textcoords="offset points")
    for i, lab in enumerate(labels):  # a mode with no measurement: say why there is no bar
        if all(stats[(lab, k)] is None for k in value_keys):
            ax.annotate("failed", (i, 0), xycoords=("data", "axes fraction"), ha="center", va="bottom", color="red",
                        fontsize=8, xytext=(0, 4), textcoords="offset points")
    if log:
        from matplotlib.ticker import FormatStrFormatter

        ax.set_yscale("log")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(FormatStrFormatter("%g"))  # 0.2, 0.5, 4 rather than 2x10^-1
    ax.set_xticks(range(len(labels)), labels, rotation=20 if len(labels) > 5 else 0)
    ax.set_ylabel(f"{unit}{' (log scale)' if log else ''}")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def series_chart(path: str, title: str, rows: list[dict], *, x_key: str, panels: list[tuple[str, str, float]],
                 x_label: str) -> str:
    """One panel per ``(row key, y label, divisor)``: the median of each x with min-max whiskers. Returns ``path``."""
    xs = sorted({r[x_key] for r in rows if "error" not in r})
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), FIG_HEIGHT_IN), squeeze=False)
    for ax, (key, ylabel, scale) in zip(axes[0], panels):
        st = [_stats([r[key] / scale for r in rows if r[x_key] == x and "error" not in r]) for x in xs]
        med = [s[0] for s in st]
        ax.errorbar(xs, med, yerr=[[m - s[1] for m, s in zip(med, st)], [s[2] - m for m, s in zip(med, st)]],
                    marker="o", capsize=3)
        for x, v in zip(xs, med):
            ax.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=7, xytext=(0, 3), textcoords="offset points")
        ax.set_xticks(xs)
        ax.set_xlabel(x_label)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _write_chart(path: str, title: str, rows: list[dict]) -> str:
    return grouped_bars(path, title, rows)


def _read_chart(path: str, title: str, rows: list[dict]) -> str:
    return series_chart(path, title, rows, x_key="readers", x_label="N readers",
                        panels=[("wall_s", "time until all finished (s)", 1.0),
                                ("s3_tx_bytes", "bytes S3 sent (MiB)", MiB)])


def _dcp_chart(path: str, title: str, rows: list[dict]) -> str:
    """Save, durable and load seconds per mode x DCP's own dedup."""
    labelled = [{**r, "label": f"{r['mode']}\nDCP dedup {'on' if r.get('dcp_dedup') else 'off'}"} for r in rows]
    return grouped_bars(path, title, labelled, label_key="label",
                        value_keys={"save_s": "dcp.save (slowest rank)", "durable_s": "durable (all in S3)",
                                    "load_s": "dcp.load from cold pools"})


def _load_chart(path: str, title: str, rows: list[dict]) -> str:
    """Load time of the slowest node per mode x N readers (x warm); skipped modes are left out."""
    labelled = [{**r, "label": f"{r['mode']}\nN={r['readers']}{' warm' if r.get('phase') == 'warm' else ''}"}
                for r in rows if "skipped" not in r and "load_s" in r]
    return grouped_bars(path, title, labelled, label_key="label", value_keys={"load_s": "load (slowest node)"})


# scenario -> chart(path, title, rows); scenarios not listed get grouped_bars when their rows have
# close_s and durable_s, else no chart
CHARTS: dict[str, Callable[[str, str, list[dict]], str]] = {
    "dp": _write_chart, "rank0": _write_chart, "sharded": _write_chart, "read": _read_chart, "dcp": _dcp_chart,
    "load": _load_chart,
}


def save(stem: str, scenario: str, rows: list[dict], title: str) -> str | None:
    """``<stem>-<scenario>.png`` for ``rows``; its path, or None when the scenario has no chart."""
    chart = CHARTS.get(scenario)
    if chart is None and any("close_s" in r and "durable_s" in r for r in rows):
        chart = _write_chart
    if chart is None or not rows:
        return None
    return chart(f"{stem}-{scenario}.png", title, rows)


def save_all(stem: str, results: dict[str, list[dict]], titles: dict[str, str]) -> list[str]:
    """A chart per scenario that has one; the paths written."""
    return [p for s, rows in results.items() if (p := save(stem, s, rows, titles.get(s, s)))]
