"""PNG plots of bench rows: speedup bars, accepted-length histograms, draft-length traces."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

import matplotlib

matplotlib.use("Agg")  # files only; no display on CI or the GPU hosts
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import numpy as np  # noqa: E402

from jspec.bench.report import method_label  # noqa: E402

Row = dict[str, Any]


def _by(rows: Iterable[Row], *keys: str) -> dict[tuple, list[Row]]:
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for row in rows:
        groups[tuple(row[k] for k in keys)].append(row)
    return dict(sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))))


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _grouped_bars(ax, groups: list[str], series: dict[str, list[float]]) -> None:
    """Horizontal bars, one row per method, grouped by task: labels stay readable with many methods."""
    height = 0.8 / max(len(groups), 1)
    labels = list(series)
    y = np.arange(len(labels))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, task in enumerate(groups):
        vals = [series[m][j] for m in labels]
        ax.barh(y + (j - (len(groups) - 1) / 2) * height, vals, height, label=task, color=colors[j % len(colors)])
    ax.set_yticks(y, labels, fontsize="small")
    ax.invert_yaxis()
    if len(groups) > 1:
        ax.legend(fontsize="small")


def plot_speedup(rows: list[Row], out_dir: Path) -> list[Path]:
    """Speedup over AR per task, one bar per method, one figure per (batch, dtype)."""
    paths = []
    for (batch, dtype), group in _by(rows, "batch", "dtype").items():
        group = [r for r in group if r["method"] != "ar" and r["speedup_vs_ar"] is not None]
        if not group:
            continue
        tasks = sorted({r["task"] for r in group})
        series: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(tasks))
        for r in group:
            series[method_label(r)][tasks.index(r["task"])] = r["speedup_vs_ar"]
        fig, ax = plt.subplots(figsize=(7, 1.2 + 0.32 * len(series) * max(1, len(tasks) / 2)))
        _grouped_bars(ax, tasks, dict(series))
        ax.axvline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xlabel("speedup vs jspec AR (same run)")
        ax.set_title(f"{group[0]['target']}: {', '.join(tasks)}, batch {batch}, {dtype}, {group[0].get('card', '')}", fontsize="medium")
        paths.append(_save(fig, out_dir / f"speedup_b{batch}_{dtype}.png"))
    return paths


def plot_accepted_histograms(rows: list[Row], out_dir: Path) -> list[Path]:
    """Share of target calls that added n tokens, per method, one figure per (task, batch, dtype)."""
    paths = []
    for (task, batch, dtype), group in _by(rows, "task", "batch", "dtype").items():
        group = [r for r in group if r.get("accepted_length_hist")]
        if not group:
            continue
        hists = {method_label(r): {int(k): v for k, v in r["accepted_length_hist"].items()} for r in group}
        lengths = sorted({n for h in hists.values() for n in h})
        series = {m: [h.get(n, 0) / sum(h.values()) for n in lengths] for m, h in hists.items()}
        # small multiples: one panel per method, same axes
        fig, axes = plt.subplots(len(series), 1, figsize=(6, 1.3 * len(series) + 1), sharex=True, sharey=True, squeeze=False)
        for ax, (label, shares) in zip(axes[:, 0], series.items()):
            ax.bar(lengths, shares, color="tab:blue")
            ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize="small")
        axes[-1, 0].set_xlabel("tokens added per target call (bonus included); bar = share of calls")
        axes[-1, 0].set_xticks(lengths)
        fig.suptitle(f"{group[0]['target']}: accepted length ({task}, batch {batch}, {dtype})", fontsize="medium")
        paths.append(_save(fig, out_dir / f"accepted_hist_{task}_b{batch}_{dtype}.png"))
    return paths


def _is_dynamic(row: Row) -> bool:
    return row["method"] == "spec" and str(row.get("policy")) not in ("static", "None")


def plot_draft_traces(rows: list[Row], out_dir: Path) -> list[Path]:
    """Draft length per round over one generation (the first prompt) for dynamic policies."""
    paths = []
    for (task, batch, dtype), group in _by(rows, "task", "batch", "dtype").items():
        group = [r for r in group if _is_dynamic(r) and (r.get("trace") or {}).get("draft_lengths")]
        if not group:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in group:
            ax.step(range(len(r["trace"]["draft_lengths"])), r["trace"]["draft_lengths"], where="post", label=method_label(r))
        ax.set_xlabel("round")
        ax.set_ylabel("draft length")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize="small")
        ax.set_title(f"{group[0]['target']}: draft length over one generation ({task}, batch {batch}, {dtype})")
        paths.append(_save(fig, out_dir / f"draft_traces_{task}_b{batch}_{dtype}.png"))
    return paths


def plot_all(rows: list[Row], out_dir: str | Path) -> list[Path]:
    out_dir = Path(out_dir)
    return plot_speedup(rows, out_dir) + plot_accepted_histograms(rows, out_dir) + plot_draft_traces(rows, out_dir)
