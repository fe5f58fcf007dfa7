#!/usr/bin/env python
"""jspec autoregressive decoding vs transformers generate on MT-Bench first turns, batch 1 and 16,
256 new tokens. Any bench option overrides these defaults (e.g. --model, --n-prompts)."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU

from jspec.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    main(tasks="mt_bench", methods="ar,hf", batch="1,16", max_new_tokens=256, out="jspec-results/ar_vs_hf")
