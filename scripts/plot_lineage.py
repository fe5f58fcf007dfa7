"""A head's curve across training rounds: accepted tokens per target call against the sequences
it has seen and the GPU-minutes spent distilling and training, from a lineage file
(`models/<preset>/head_lineage.json`, `heads/eagle3/lineage.json`).

    python scripts/plot_lineage.py models/qwen2.5-coder-1.5b-instruct/head_lineage.json --out curve.png

Each series is one timed measurement the points share a key for (`h100` / `h200`: e.g.
`humaneval_chain_k6`); a point without it leaves a gap. GPU-minutes add up over the rounds a head
descends from: a point marked `"from": "scratch"` (a new head) starts them again.
"""

from __future__ import annotations

import argparse
import json


def series(points: list[dict]) -> dict[str, list[tuple[int, float, float]]]:
    """{card/measurement: [(sequences_seen, cumulative GPU-minutes, tokens per call), ...]} in round order."""
    out: dict[str, list[tuple[int, float, float]]] = {}
    minutes = 0.0
    for p in points:
        if p.get("from") == "scratch":
            minutes = 0.0
        minutes += sum(float(v) for v in (p.get("gpu_minutes") or {}).values())
        for card in ("h100", "h200"):
            for name, m in (p.get(card) or {}).items():
                if isinstance(m, dict) and "tokens_per_call" in m:
                    out.setdefault(f"{card}: {name}", []).append((int(p["sequences_seen"]), minutes, float(m["tokens_per_call"])))
    return out


def plot(lineage: dict, out: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = lineage["points"]
    curves = series(points)
    # one colour per measurement, one marker and line style per card: the same measurement on two
    # cards reads as one quantity, and two series never share a look
    measurements = sorted({name.split(": ", 1)[1] for name in curves})
    colour = {m: plt.get_cmap("tab10" if len(measurements) <= 10 else "tab20")(i) for i, m in enumerate(measurements)}
    style = {"h100": "o-", "h200": "s--"}
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    for name, pts in sorted(curves.items()):
        card, measurement = name.split(": ", 1)
        look = dict(color=colour[measurement], label=name)
        ax[0].plot([s for s, _, _ in pts], [t for _, _, t in pts], style[card], **look)
        ax[1].plot([m for _, m, _ in pts], [t for _, _, t in pts], style[card], **look)
    ax[0].set_xlabel("training sequences seen")
    ax[1].set_xlabel("GPU-minutes (distilling and training, cumulative)")
    ax[0].set_ylabel("tokens per target call")
    for p in points:  # version labels along the first axis
        ax[0].axvline(p["sequences_seen"], color="0.85", lw=0.8, zorder=0)
        ax[0].text(p["sequences_seen"], ax[0].get_ylim()[0], f" {p['version']}", fontsize=8, va="bottom")
    ax[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.suptitle(title or "head rounds: tokens per call")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("lineage", help="a lineage JSON file ({'points': [...]})")
    p.add_argument("--out", default="lineage.png")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    try:
        with open(args.lineage) as fh:
            lineage = json.load(fh)
    except (OSError, ValueError) as e:
        p.error(f"{args.lineage}: not a readable lineage JSON file ({type(e).__name__})")
    if not isinstance(lineage, dict) or not lineage.get("points"):
        p.error(f"{args.lineage}: no 'points' (a lineage file holds {{'points': [...]}}, one per round)")
    plot(lineage, args.out, args.title)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
