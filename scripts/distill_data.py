"""Build a self-distillation dataset only: the target answers the recipe's prompts.

    python scripts/distill_data.py --target smollm2-135m --recipe training/smollm2-eagle3.json --data runs/data
"""

import sys

from jspec.train.cli import main

if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(lambda: main([*sys.argv[1:], "--distill-only"]), "distill_data.py"))
