"""Training curves from a metrics.jsonl written by `jspec train-head`: loss, top-1 accuracy per
training-time-test step (held-out accuracy too, from holdout_metrics.jsonl beside it), learning
rate and tokens/s, against the step.

    python scripts/plot_training.py runs/device/eagle3/metrics.jsonl --out models/smollm2-135m-instruct/heads/eagle3/training_curves.png
"""

from __future__ import annotations

import argparse
import json
import os


def load(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def plot(rows: list[dict], out: str, title: str = "", held: list[dict] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    accs = sorted((k for k in rows[0] if k.startswith("acc_")), key=lambda k: int(k.split("_")[1]))
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    ax[0, 0].plot(steps, [r["loss"] for r in rows], color="black", lw=1.2)
    ax[0, 0].set_title("loss (sum over TTT steps, weights 0.8^j)" if len(accs) > 1 else "loss")
    for k in accs:
        line, = ax[0, 1].plot(steps, [r[k] for r in rows], lw=1.1, alpha=0.5 if held else 1.0,
                              label=f"step {k.split('_')[1]}")
        if held:  # held-out points in the same colour, solid
            ax[0, 1].plot([r["step"] for r in held], [r[k] for r in held], "o-", ms=2.5, color=line.get_color())
    ax[0, 1].set_title("top-1 accuracy vs the target's argmax" + (" (dots: held out)" if held else ""))
    ax[0, 1].set_ylim(0, 1)
    ax[0, 1].legend(fontsize=8, ncol=2)
    ax[1, 0].plot(steps, [r["lr"] for r in rows], color="tab:green")
    ax[1, 0].set_title("learning rate")
    tps = [r.get("tokens_per_s_per_device", r["tokens_per_s"]) for r in rows]
    ax[1, 1].plot(steps[1:], tps[1:], color="tab:purple")  # the first interval includes compilation
    ax[1, 1].set_title("training tokens/s per device (non-padding)")
    for a in ax.flat:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", help="metrics.jsonl")
    p.add_argument("--out", default="training_curves.png")
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    rows = load(a.metrics)
    if not rows:
        raise SystemExit(f"{a.metrics} has no rows")
    held_path = os.path.join(os.path.dirname(a.metrics), "holdout_metrics.jsonl")
    plot(rows, a.out, a.title, load(held_path) if os.path.isfile(held_path) else None)
    print(f"wrote {a.out} ({len(rows)} points, last step {rows[-1]['step']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
