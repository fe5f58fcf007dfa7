"""Products of 1-8 rows on the CUDA cores (`gemv.cu`): the decode step's fast path on sm_90+ GPUs.

`matvec.py` routes a product here when this kernel serves it (`serves`): bfloat16 x and W, at
most MAX_ROWS rows, W's contiguous dimension a multiple of 8, a GPU of compute capability 9.0 or
more (split-K runs as thread-block clusters) and a library that builds. Everything else, and
every other platform, keeps the Pallas kernel or XLA's dot; the tests check this kernel against
`x @ W` where a GPU and nvcc are present, and its block rule and one-line errors everywhere.

Block choice per product: (block_n, split) from `gemv_tuning.json` (per card and product, measured
by `scripts/bench_shapes.py --parts gemm`, with whether the kernel beat the Pallas kernel and
XLA's dot there: JSPEC_MATMUL=auto uses it only where it did), else `default_blocks`. The choice depends on K and N only,
never on the row count, so a row's result is the same in a one-row decode step and in an 8-row
verify step.

The source is built with nvcc on first use (`cuda_build`); a machine without nvcc, or a failed
build, warns once and falls back to the Pallas kernel.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from . import cuda_build
from .card import card_name, sm_count

SOURCE = Path(__file__).with_name("gemv.cu")
TARGET = "jspec_gemv"
TUNING_FILE = Path(__file__).with_name("gemv_tuning.json")
MAX_ROWS = 8  # the source's kMaxRows
MAX_SPLIT = 8  # the portable thread-block cluster size
BLOCK_NS = (64, 128, 256)
THREADS = 256  # the source's kThreads
UNROLL = 8  # the source's kUnroll
UNSET_HINT = "set JSPEC_MATMUL=matvec to use the Pallas kernel instead"


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether this process can run the kernel: its first device a CUDA GPU of compute capability
    9.0 or more, and the library built and registered (once; a failure warns once)."""
    try:
        device = jax.devices()[0]
    except Exception:  # noqa: BLE001 - no device: nothing to run on
        return False
    if device.platform != "gpu":
        return False
    try:
        major = int(str(device.compute_capability).split(".")[0])
    except Exception:  # noqa: BLE001 - a GPU that does not say what it is (ROCm)
        return False
    if major < 9:
        return False
    try:
        lib = cuda_build.load(SOURCE, unset_hint=UNSET_HINT)
    except RuntimeError as err:
        warnings.warn(f"the CUDA few-row product kernel is unavailable, the Pallas kernel serves instead: {err}",
                      stacklevel=2)
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JspecGemv), platform="CUDA")
    return True


def serves(M: int, K: int, N: int, *, transposed: bool, w_dtype, x_dtype) -> bool:
    """Whether the CUDA kernel runs this product (else the caller's other path does)."""
    return (1 <= M <= MAX_ROWS and jnp.dtype(w_dtype) == jnp.bfloat16 and jnp.dtype(x_dtype) == jnp.bfloat16
            and (K if transposed else N) % 8 == 0 and available())


@functools.lru_cache(maxsize=None)
def _tuning_table(card: str) -> dict:
    env = os.environ.get("JSPEC_GEMV_TUNING")
    path = Path(env) if env else TUNING_FILE
    if not path.exists():
        return {}
    return json.loads(path.read_text()).get(card, {})


def tuning_key(K: int, N: int, transposed: bool) -> str:
    return f"{K}x{N}{'t' if transposed else ''}"


def default_blocks(K: int, N: int, *, transposed: bool, sms: int | None = None) -> tuple[int, int]:
    """(block_n, split) for a product: the widest column block, then the fewest K splits, that give
    the grid at least two blocks per SM while each thread row still streams at least one unrolled
    step of its K range. (The [N, K] layout has one block shape: (0, 1).)"""
    if transposed:
        return 0, 1
    sms = sms or sm_count()
    for block_n in sorted(BLOCK_NS, reverse=True):
        columns = -(-N // block_n)
        rows_per_step = (THREADS // (block_n // 8)) * UNROLL
        split = 1
        while columns * split < 2 * sms and split < MAX_SPLIT and K // (2 * split) >= rows_per_step:
            split *= 2
        if columns * split >= 2 * sms or block_n == BLOCK_NS[0]:
            return block_n, split
    raise AssertionError("unreachable")


def candidate_blocks(K: int, N: int, *, transposed: bool) -> list[tuple[int, int]]:
    """What bench_shapes --parts gemm times: every block_n with every split dividing it."""
    if transposed:
        return [(0, 1)]
    return [(bn, split) for bn in BLOCK_NS for split in (1, 2, 4, 8) if split <= MAX_SPLIT and bn % split == 0]


def pick_blocks(K: int, N: int, *, transposed: bool) -> tuple[int, int]:
    hit = _tuning_table(card_name()).get(tuning_key(K, N, transposed))
    return tuple(hit["blocks"]) if hit else default_blocks(K, N, transposed=transposed)


def measured_faster(M: int, K: int, N: int, *, transposed: bool, dtype) -> bool:
    """Whether this card's table says the kernel beat both the Pallas kernel and XLA's dot on this
    product at one row (bench_shapes --parts gemm): what JSPEC_MATMUL=auto goes by."""
    hit = _tuning_table(card_name()).get(tuning_key(K, N, transposed))
    return bool(hit and hit.get("faster")) and serves(M, K, N, transposed=transposed, w_dtype=dtype, x_dtype=dtype)


def check_blocks(blocks: tuple[int, int], *, transposed: bool) -> None:
    block_n, split = blocks
    if transposed:
        if blocks != (0, 1):
            raise ValueError(f"gemv: blocks {blocks} for W [N, K]: the layout has one block shape, (0, 1)")
        return
    if block_n not in BLOCK_NS or not 1 <= split <= MAX_SPLIT or block_n % split:
        raise ValueError(f"gemv: blocks {blocks}: block_n one of {BLOCK_NS}, split 1-{MAX_SPLIT} dividing it")


def gemv(x: jax.Array, w: jax.Array, *, layer=None, transposed: bool = False, out_dtype=None,
         blocks: tuple[int, int] | None = None) -> jax.Array:
    """x [M, K] @ W ([K, N], stacked [L, K, N] read at `layer`, or [N, K] with `transposed`) in
    out_dtype (bfloat16 or float32, default x's), the float32 sum rounded once."""
    M, K = x.shape
    N = w.shape[-2] if transposed else w.shape[-1]
    blocks = tuple(blocks) if blocks is not None else pick_blocks(K, N, transposed=transposed)
    check_blocks(blocks, transposed=transposed)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    layer_arr = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((M, N), out_dtype))
    return call(layer_arr, x, w, transposed=bool(transposed), stacked=layer is not None,
                block_n=np.int64(blocks[0]), split=np.int64(blocks[1]))
