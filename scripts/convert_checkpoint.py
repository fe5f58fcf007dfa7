#!/usr/bin/env python
"""Convert a checkpoint: HF dir / GGUF / preset -> jspec Orbax, or Orbax -> HF safetensors.

    python scripts/convert_checkpoint.py smollm2-135m-instruct /tmp/smollm2-orbax
    python scripts/convert_checkpoint.py /tmp/smollm2-orbax /tmp/smollm2-hf --to hf
"""

import argparse
import sys

from jspec.checkpoint.convert import add_convert_args, run_convert


def main(argv=None) -> int:
    parser = add_convert_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    return run_convert(parser.parse_args(argv))


if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "convert_checkpoint.py"))
