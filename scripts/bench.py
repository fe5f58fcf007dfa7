#!/usr/bin/env python
"""Benchmark decoding methods side by side: `python scripts/bench.py --model PRESET --methods ar,hf,...`."""

import os

# The HF peer shares the GPU with JAX in this process: don't let XLA grab 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from jspec.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
