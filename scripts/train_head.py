"""Train an EAGLE draft head on self-distilled data (same as `jspec train-head`).

    python scripts/train_head.py --target smollm2-135m --recipe training/smollm2-eagle3.json
"""

from jspec.train.cli import main

if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "train_head.py"))
