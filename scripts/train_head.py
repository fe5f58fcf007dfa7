"""Train an EAGLE draft head on self-distilled data (same as `jspec train-head`).

    python scripts/train_head.py --target smollm2-135m --recipe training/smollm2-eagle3.json
"""

from jspec.train.cli import main

if __name__ == "__main__":
    main()
