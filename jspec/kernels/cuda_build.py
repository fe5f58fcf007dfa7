"""Build a CUDA source of jspec's into a shared library with nvcc, once per machine, and load it.

The CUDA kernels (the p2p all-reduce, the few-row products) are XLA FFI targets compiled on first
use, so the wheel ships sources only. The library is cached under $JSPEC_CACHE (default
~/.cache/jspec)/kernels, keyed by the source, JAX (its FFI headers), nvcc and the GPU, so an
upgrade of any of them rebuilds it. `unset_hint` completes each one-line error: what the user sets
to go back to the portable path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import jax


def cache_dir() -> Path:
    return Path(os.environ.get("JSPEC_CACHE", Path.home() / ".cache" / "jspec")) / "kernels"


def nvcc(unset_hint: str) -> str:
    path = shutil.which("nvcc")
    if path is None:
        raise RuntimeError(f"building a jspec CUDA kernel needs nvcc on PATH: install the CUDA toolkit or {unset_hint}")
    return path


def build_command(source: Path, out: Path, *, arch: str = "native", unset_hint: str = "") -> list[str]:
    """nvcc's command line for the shared library (arch "native": the GPUs of the machine building it)."""
    return [nvcc(unset_hint), "-std=c++17", "-O3", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC",
            "-diag-suppress", "940,2473", f"-I{jax.ffi.include_dir()}", str(source), "-o", str(out)]


def build_tag(source: Path, unset_hint: str) -> str:
    """What a cached library depends on: the source, JAX, nvcc and the GPU."""
    version = subprocess.run([nvcc(unset_hint), "--version"], capture_output=True, text=True).stdout
    gpu = getattr(jax.devices()[0], "compute_capability", jax.devices()[0].device_kind)
    return hashlib.sha256(source.read_bytes() + f"{jax.__version__}|{version}|{gpu}".encode()).hexdigest()[:16]


def load(source: Path, *, unset_hint: str) -> ctypes.CDLL:
    """The built library of `source` (built now if this machine has none cached)."""
    path = cache_dir() / f"{source.stem}-{build_tag(source, unset_hint)}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        run = subprocess.run(build_command(source, tmp, unset_hint=unset_hint), capture_output=True, text=True)
        if run.returncode != 0:
            last = (run.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"building {source.name} with nvcc failed ({last}): {unset_hint}")
        os.replace(tmp, path)
    return ctypes.CDLL(str(path))
