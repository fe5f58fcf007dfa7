"""Checkpoint conversion: HF dir / GGUF / preset -> Orbax, and Orbax (or anything) -> HF safetensors.

The source's tokenizer travels along when it can be loaded (into <dst>/tokenizer for Orbax, into
<dst> itself for HF), so a converted checkpoint is self-contained for `resolve_model`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..errors import UsageError
from ..presets import load_checkpoint, load_tokenizer_if_any, resolve_checkpoint
from ..tokenizer import ORBAX_TOKENIZER_DIR
from .hf import export_hf
from .orbax_io import save_params

FORMATS = ("orbax", "hf")
DTYPES = ("float32", "bfloat16")


def default_format(src_kind: str) -> str:
    """Orbax sources go to HF, everything else to Orbax."""
    return "hf" if src_kind == "orbax" else "orbax"


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    fmt: str | None = None,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    tokenizer: bool = True,
) -> Path:
    """Convert `src` (preset name, HF dir, .gguf file or Orbax dir) to `fmt` at `dst`."""
    import jax.numpy as jnp

    src_path, src_kind, _ = resolve_checkpoint(src)
    fmt = fmt or default_format(src_kind)
    if fmt not in FORMATS:
        raise ValueError(f"unknown target format {fmt!r}; choose from {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    out = Path(dst)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out}: exists and is not an empty directory (pass overwrite=True to replace it)")

    cfg, params = load_checkpoint(src_path, src_kind, jnp.dtype(dtype))
    if fmt == "orbax":
        out = save_params(out, params, cfg, overwrite=overwrite)
    else:
        out = export_hf(params, cfg, out)
    if tokenizer:
        _copy_tokenizer(src_path, src_kind, out, fmt)
    return out


def _copy_tokenizer(src_path: Path, src_kind: str, out: Path, fmt: str) -> None:
    try:
        tok = load_tokenizer_if_any(src_path, src_kind)
    except Exception as e:  # noqa: BLE001 - the weights are converted; say why the tokenizer is not
        print(f"warning: {src_path}: tokenizer not copied ({type(e).__name__}: {e})", file=sys.stderr)
        return
    if tok is None:
        print(f"warning: {src_path}: has no tokenizer; {out} will have none either", file=sys.stderr)
        return
    tok.save_pretrained(str(out / ORBAX_TOKENIZER_DIR if fmt == "orbax" else out))


def add_convert_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("src", help="preset name, HF model dir, .gguf file, or jspec Orbax dir")
    parser.add_argument("dst", help="output directory")
    parser.add_argument(
        "--to", dest="fmt", choices=FORMATS, default=None, help="target format (default: hf for an Orbax source, else orbax)"
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="stored parameter dtype (default float32)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    parser.add_argument("--no-tokenizer", dest="tokenizer", action="store_false", help="do not copy the tokenizer")
    return parser


def run_convert(args: argparse.Namespace) -> int:
    dst = Path(args.dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not args.overwrite:
        raise UsageError(f"{dst}: exists and is not an empty directory; add --overwrite to replace it")
    out = convert(args.src, args.dst, args.fmt, dtype=args.dtype, overwrite=args.overwrite, tokenizer=args.tokenizer)
    print(f"wrote {out}")
    return 0


__all__ = ["add_convert_args", "convert", "run_convert"]
