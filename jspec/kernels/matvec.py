"""Bandwidth-bound matrix products for few rows (decode, verify, draft steps): `x @ W` with x [M, K],
M small, streaming W once at the card's memory bandwidth.

Why a kernel of our own: at batch 1 a decoder step is one pass over the weights, so its speed is
the fraction of HBM bandwidth its matrix products reach. XLA's GPU lowering of a one-row product
reaches about a third of it at 8B shapes with its Triton GEMMs (a grid too small to keep enough
loads in flight), and its cuBLAS route loses to Triton at 1B; neither choice is right for every
shape. This kernel is one simple shape-parametrised program:

    grid (ceil(N / BN), S): program (n, s) owns output columns [n*BN, +BN) and the K range
    [s*K/S, +K/S); it walks that range in BK-row tiles (software-pipelined by Triton over
    `num_stages` buffers) and accumulates x_tile @ W_tile in float32 on the tensor cores
    (rows masked up to 16, the smallest MMA tile: the padding rows are never read from memory).
    Without a split (S = 1) each program stores its columns rounded to the output dtype: no
    kernel runs after it. Split-K (S > 1) writes float32 partials [S, M, N] that XLA sums in the
    caller's next fusion (with its residual), so every program does a fixed share and results
    are deterministic (no atomics).

One-row products may instead multiply and sum on the CUDA cores (`Blocks(..., fma=1)`, the
row a [BK] vector, no padding to a tensor-core tile) where the tuning measured that faster.

`W` may be:
  * [K, N] (a projection), or [N, K] with `transposed=True` (a tied embedding as the LM head,
    read along its contiguous rows);
  * stacked [L, K, N] with a traced `layer` index: the layer is read in place, so a layer loop
    over stacked weights copies no weight slices.

The block shape (BN, BK, S, warps, stages) is picked per (card, rows, K, N, layout) from
`matvec_tuning.json` (measured by scripts/bench_shapes.py --tune; a row count the table lacks takes
the next larger tuned count's entry, `tuned_entry`), else by a rule that gives every
SM several programs; then fitted to the card's shared memory (`fit_blocks`: an entry measured at
fewer rows, or on a card with more of it, may not fit as it is). The portable path (CPU, TPU,
meshes) is `x @ W`; tests run this kernel in Pallas interpret mode against it.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..cards import card_name

MAX_ROWS = 64  # rows (batch x tokens) in one tile; more rows go to XLA's GEMMs (compute starts to matter)
MIN_ELEMENTS = 1 << 20  # smaller matrices are launch-bound, not bandwidth-bound: XLA's dot serves them
# $JSPEC_MATMUL (read when a program is traced): "auto" (the tuning table, else the rule), "matvec"
# (the kernel wherever rows <= MAX_ROWS) or "xla" (never the kernel): for A/B benchmarks.
MATMUL_CHOICES = ("auto", "matvec", "xla")
TUNING_FILE = Path(__file__).with_name("matvec_tuning.json")
_SMS_FALLBACK = 132  # H100 SXM; only used when the device does not report its core count


class Blocks(tuple):
    """(block_n, block_k, split_k, num_warps, num_stages), and a trailing 1 (`fma`) where a one-row
    product multiplies and sums on the CUDA cores instead of padding its row to a tensor-core tile."""

    __slots__ = ()

    def __new__(cls, bn, bk, split, warps, stages, fma=0):
        return super().__new__(cls, (int(bn), int(bk), int(split), int(warps), int(stages)) + ((1,) if fma else ()))

    @property
    def fma(self) -> bool:
        return len(self) > 5 and bool(self[5])


def _pad_rows(m: int) -> int:
    return max(16, 1 << (m - 1).bit_length())


def _load(ref_at, mask):
    """A masked load (masked-off elements read as 0); mask None: every element is in bounds."""
    return plgpu.load(ref_at) if mask is None else plgpu.load(ref_at, mask=mask, other=0)


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, M, BM, K, N, BK, BN, KS, transposed, stacked, mask_n, mask_k,
            summed, fma):
    n = pl.program_id(0)
    s = pl.program_id(1)
    at = (lambda *idx: w_ref.at[(layer_ref[0], *idx)]) if stacked else (lambda *idx: w_ref.at[idx])  # one indexer
    # fma: the one row as a vector [BK] (x) and [BN] (the result); else rows padded to BM
    rows = jnp.int32(0) if fma else pl.ds(0, BM)
    r_ok = jnp.arange(BM) < M
    cols = n * BN + jnp.arange(BN)
    c_ok = cols < N
    k_start = s * KS
    precision = lax.Precision.HIGHEST if w_ref.dtype == jnp.float32 else None

    def load_x(col0, k_ok):
        """x's columns [col0, col0 + BK) for rows < M."""
        if fma:
            mask = k_ok if mask_k else None
        else:
            mask = r_ok[:, None] & (k_ok[None, :] if mask_k else True)
        return _load(x_ref.at[rows, pl.ds(col0, BK)], mask)

    def body(i, acc):
        k0 = k_start + i * BK
        kb = pl.ds(k0, BK)
        k_ok = (k0 + jnp.arange(BK)) < K
        xb = load_x(k0, k_ok).astype(w_ref.dtype)
        if transposed:  # W [N, K]: tile [BN, BK], contiguous along K
            mask = (c_ok[:, None] if mask_n else True) & (k_ok[None, :] if mask_k else True)
            wb = _load(at(pl.ds(n * BN, BN), kb), None if mask is True else mask)
            if fma:
                return acc + jnp.sum(wb.astype(jnp.float32) * xb.astype(jnp.float32)[None, :], axis=1)
            dims = (((1,), (1,)), ((), ()))
        else:  # W [K, N]: tile [BK, BN], contiguous along N
            mask = (k_ok[:, None] if mask_k else True) & (c_ok[None, :] if mask_n else True)
            wb = _load(at(kb, pl.ds(n * BN, BN)), None if mask is True else mask)
            if fma:
                return acc + jnp.sum(wb.astype(jnp.float32) * xb.astype(jnp.float32)[:, None], axis=0)
            dims = (((1,), (0,)), ((), ()))
        return acc + lax.dot_general(xb, wb, dims, preferred_element_type=jnp.float32, precision=precision)

    acc = lax.fori_loop(0, KS // BK, body, jnp.zeros((BN,) if fma else (BM, BN), jnp.float32))
    out = o_ref.at[rows, pl.ds(n * BN, BN)] if summed else o_ref.at[s, rows, pl.ds(n * BN, BN)]
    if fma:
        mask = c_ok if mask_n else None
    else:
        mask = r_ok[:, None] & (c_ok[None, :] if mask_n else True)
    if mask is None:
        plgpu.store(out, acc.astype(o_ref.dtype))
    else:
        plgpu.store(out, acc.astype(o_ref.dtype), mask=mask)


def k_partition(K: int, bk: int, split: int) -> tuple[int, int]:
    """(K per split, splits) of a product of depth K: each split owns a whole number of BK tiles, the
    last may run past K (masked), so fewer splits than asked remain where K runs out."""
    ks = -(-K // (split * bk)) * bk
    return ks, -(-K // ks)


def _pallas_matvec(x, w, *, layer, transposed, blocks: Blocks, out_dtype, interpret):
    """x [M, K] @ W: [M, N] in out_dtype when the blocks keep K whole (one program per column
    block sums everything: the result is stored rounded, no kernel after), else float32 partial
    products [S, M, N] to be summed."""
    M, K = x.shape
    stacked = layer is not None
    kn = w.shape[-2:]
    N = kn[0] if transposed else kn[1]
    if (kn[1] if transposed else kn[0]) != K:
        raise ValueError(f"matvec: x {x.shape} does not match W {w.shape}{' read transposed' if transposed else ''}")
    if M > MAX_ROWS:
        raise ValueError(f"matvec: {M} rows, at most {MAX_ROWS}")
    bk = min(blocks[1], 1 << (K - 1).bit_length())
    # the blocks were chosen for an x of W's dtype: an x of another one may need more shared memory
    blocks = fit_blocks(M, Blocks(blocks[0], bk, *blocks[2:]), jnp.dtype(w.dtype).itemsize,
                        x_itemsize=jnp.dtype(x.dtype).itemsize)
    bn, bk, split, warps, stages = blocks[:5]
    fma = len(blocks) > 5 and bool(blocks[5]) and M == 1  # (a one-row product only)
    ks, split = k_partition(K, bk, split)
    summed = split == 1
    shape = dict(M=M, BM=_pad_rows(M), K=K, N=N, BK=bk, BN=bn, KS=ks, transposed=transposed, stacked=stacked,
                 mask_n=N % bn != 0, mask_k=(split * ks) != K, summed=summed, fma=fma)
    layer_arr = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    out_shape = jax.ShapeDtypeStruct((M, N), out_dtype) if summed else jax.ShapeDtypeStruct((split, M, N), jnp.float32)
    return _kernel_call(layer_arr, x, w, shape=tuple(shape.items()), grid=(pl.cdiv(N, bn), split),
                        out_shape=out_shape, warps=warps, stages=stages, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("shape", "grid", "out_shape", "warps", "stages", "interpret"))
def _kernel_call(layer_arr, x, w, *, shape, grid, out_shape, warps, stages, interpret):
    """The kernel's launch as a program of its own: a forward's layers call one product of one
    shape with the same blocks many times, and JAX traces and lowers such a call once per program
    (the Triton lowering of each launch was most of a tree program's lowering); XLA inlines it."""
    return pl.pallas_call(
        functools.partial(_kernel, **dict(shape)),
        grid=grid,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="jspec_matvec",
    )(layer_arr, x, w)


def matvec(x, w, *, layer=None, transposed=False, blocks: Blocks | None = None, out_dtype=None, interpret=False):
    """x [..., K] @ W for few rows, W [K, N] / [N, K] (transposed) / [L, K, N] (with `layer`).

    Returns [..., N] in out_dtype (default x's dtype): the float32 sum rounded once, as XLA's
    dot with preferred_element_type=float32 followed by a cast computes it.

    Differentiable in x and W (XLA's dots backwards) when `layer` is None."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    lead = x.shape[:-1]
    K = x.shape[-1]
    N = w.shape[-2] if transposed else w.shape[-1]
    if blocks is None:
        blocks = default_blocks(math.prod(lead), K, N, transposed=transposed)
    if layer is None:
        return _matvec_vjp(x, w, transposed, blocks, out_dtype, interpret)
    out = _pallas_matvec(x.reshape(-1, K), w, layer=layer, transposed=transposed, blocks=blocks, out_dtype=out_dtype,
                         interpret=interpret)
    if out.ndim == 2:
        return out.reshape(*lead, N)
    return jnp.sum(out, axis=0).astype(out_dtype).reshape(*lead, N)


def _reference(x, w, transposed, out_dtype):
    """The portable function the kernel computes (its backward pass)."""
    return jnp.dot(x, w.T if transposed else w, preferred_element_type=jnp.float32).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _matvec_vjp(x, w, transposed, blocks, out_dtype, interpret):
    out = _pallas_matvec(x.reshape(-1, x.shape[-1]), w, layer=None, transposed=transposed, blocks=blocks,
                         out_dtype=out_dtype, interpret=interpret)
    if out.ndim == 3:
        out = jnp.sum(out, axis=0).astype(out_dtype)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _matvec_fwd(x, w, transposed, blocks, out_dtype, interpret):
    return _matvec_vjp(x, w, transposed, blocks, out_dtype, interpret), (x, w)


def _matvec_bwd(transposed, blocks, out_dtype, interpret, res, g):
    x, w = res
    _, pullback = jax.vjp(lambda x, w: _reference(x, w, transposed, out_dtype), x, w)
    return pullback(g)


_matvec_vjp.defvjp(_matvec_fwd, _matvec_bwd)


# ---------------------------------------------------------------------------------------------
# Block selection
# ---------------------------------------------------------------------------------------------


def _sm_count() -> int:
    try:
        return int(getattr(jax.devices()[0], "core_count", 0)) or _SMS_FALLBACK
    except Exception:  # noqa: BLE001 - no device info: fall back to the H100's count
        return _SMS_FALLBACK


def default_blocks(M: int, K: int, N: int, *, transposed: bool, sms: int | None = None) -> Blocks:
    """A rule that keeps the HBM busy: enough programs for ~4 per SM, each streaming >= 64 KiB.

    BN 64 columns (128-byte rows, coalesced) for [K, N]; for [N, K] the tile's rows are contiguous
    along K, so wider BK reads longer runs. Split K until the grid fills the card.

    A [K, N] product below MIN_ELEMENTS is launch-bound: BK 128 and K split (up to 8 ways, each
    split at least one tile) until the grid has about two programs per SM. That is what tuning
    chose on the H100 for SmolLM2's one-row products (576 x 576 and 576 x 960: split 4; 1536 x 576:
    split 8), where the kernel took 2.2-3.2 µs against XLA's 4.3-8.5 µs.

    Either way the blocks fit the card's shared memory (`fit_blocks`)."""
    sms = sms or _sm_count()
    if K * N < MIN_ELEMENTS and not transposed:
        bk = min(128, 1 << (K - 1).bit_length())
        programs = -(-N // 64)
        split = 1
        while split < 8 and K // (2 * split) >= bk and programs * 2 * split <= 2 * sms:
            split *= 2
        return fit_blocks(M, Blocks(64, bk, split, 4, 4))
    bn = 64 if not transposed else 32
    bk = 256 if not transposed else 512
    bk = min(bk, 1 << (K - 1).bit_length())
    while bk > 64 and smem_bytes(M, Blocks(bn, bk, 1, 4, 4)) > smem_limit():
        bk //= 2
    programs = -(-N // bn)
    split = 1
    while programs * split < 4 * sms and (K // (2 * split)) >= 2 * bk:
        split *= 2
    return fit_blocks(M, Blocks(bn, bk, split, 4, 4))


# Shared memory a thread block may opt into, by compute capability (the CUDA programming guide's
# table; jax's device reports the capability but not the size). Triton refuses a kernel above it
# ("Shared memory size limit exceeded"), so block choices are clamped to it.
_SMEM_BY_CAPABILITY = {
    (9, 0): 227 * 1024,  # H100 / H200
    (10, 0): 227 * 1024,  # B200
    (8, 0): 163 * 1024,  # A100
    (8, 6): 99 * 1024, (8, 9): 99 * 1024,  # A10, A40 / L4, L40
    (12, 0): 99 * 1024,  # RTX 50 series
}
_SMEM_UNKNOWN_GPU = 48 * 1024  # what every CUDA card gives a block without opting in (and below a ROCm
#                                card's 64 KiB): slower blocks on a card not listed, never refused ones
_SMEM_OFF_GPU = 227 * 1024  # no shared memory to fit off a GPU (interpret mode): choose as for the H100,
#                             the card _SMS_FALLBACK also stands for, so CPU runs see an H100's blocks


@functools.lru_cache(maxsize=None)
def smem_limit() -> int:
    """Bytes of shared memory one program of this kernel may use on this process's first device."""
    try:
        device = jax.devices()[0]
    except Exception:  # noqa: BLE001 - no device at all: choose as off a GPU
        return _SMEM_OFF_GPU
    if device.platform != "gpu":
        return _SMEM_OFF_GPU
    try:
        major, minor = (int(v) for v in str(device.compute_capability).split(".")[:2])
    except Exception:  # noqa: BLE001 - a GPU that does not say what it is: the smallest size any card has
        return _SMEM_UNKNOWN_GPU
    return _SMEM_BY_CAPABILITY.get((major, minor), _SMEM_UNKNOWN_GPU)


def smem_bytes(M: int, blocks: Blocks, itemsize: int = 2, *, x_itemsize: int | None = None) -> int:
    """An upper bound on the shared memory Triton gives one program of these blocks: W (and x) of
    `itemsize` bytes an element, or x of `x_itemsize`.

    Triton's software pipeline keeps copies of every tile the K loop loads: num_stages - 1 of a tile
    that only feeds arithmetic, and one more of a tile the (asynchronous, on sm_90) tensor-core
    product reads straight from shared memory. So: `stages` copies of the W tile and of an x tile
    of W's dtype; max(stages - 1, 1) copies of an x tile that is converted first (another dtype, or
    fma's row vector), plus the converted [BM, BK] operand staged for the product. The epilogue's
    layout change of the [BM, BN] float32 result reuses the loop's buffers, so it counts only where
    it is larger."""
    bn, bk, _, _, stages = blocks[:5]
    fma = len(blocks) > 5 and bool(blocks[5]) and M == 1
    bm = 1 if fma else _pad_rows(M)  # fma: the row is a [BK] vector
    x_item = x_itemsize or itemsize
    x_tile = bm * bk * x_item
    computed = x_item != itemsize or fma
    if computed:
        x_bytes = max(stages - 1, 1) * x_tile + (0 if fma else bm * bk * itemsize)
    else:
        x_bytes = stages * x_tile
    loop = x_bytes + stages * bk * bn * itemsize
    return max(loop, bm * bn * 4)


MIN_BLOCK_K = 16  # the tensor cores' K step for 16-bit inputs: no smaller tile


def fit_blocks(M: int, blocks: Blocks, itemsize: int = 2, *, limit: int | None = None,
               x_itemsize: int | None = None) -> Blocks:
    """`blocks` within `limit` bytes of shared memory (default: this card's, `smem_limit`) for
    these dtypes (`smem_bytes`'): fewer stages first (down to 1; the cheaper loss, K stays in as
    many tiles), then BK halved (down to MIN_BLOCK_K). Blocks that fit come back unchanged."""
    limit = smem_limit() if limit is None else limit
    bn, bk, split, warps, stages = blocks[:5]
    fma = len(blocks) > 5 and bool(blocks[5])
    need = lambda st, k: smem_bytes(M, Blocks(bn, k, split, warps, st, fma), itemsize,  # noqa: E731
                                    x_itemsize=x_itemsize)
    if need(stages, bk) <= limit:
        return blocks
    while stages > 1 and need(stages, bk) > limit:
        stages -= 1
    while bk > MIN_BLOCK_K and need(stages, bk) > limit:
        bk //= 2
    if need(stages, bk) > limit:
        raise ValueError(f"matvec: blocks {tuple(blocks)} at {M} rows need {need(stages, bk)} bytes of "
                         f"shared memory even at 1 stage and BK {bk}; the card has {limit}")
    return Blocks(bn, bk, split, warps, stages, fma)


@functools.lru_cache(maxsize=None)
def _tuning_table(card: str) -> dict:
    env = os.environ.get("JSPEC_MATVEC_TUNING")
    path = Path(env) if env else TUNING_FILE
    if not path.exists():
        return {}
    table = json.loads(path.read_text())
    return table.get(card, {})


def tuning_key(M: int, K: int, N: int, transposed: bool, dtype) -> str:
    """Rows bucket (1, or the padded tile of 16 / 32 / 64), K, N, layout and dtype."""
    rows = 1 if M == 1 else _pad_rows(M)
    return f"{rows}x{K}x{N}{'t' if transposed else ''}:{jnp.dtype(dtype).name}"


TUNED_ROW_BUCKETS = (16, 32, 64)  # the padded row tiles a table may hold entries for (besides one row)


def tuned_entry(table: dict, M: int, K: int, N: int, transposed: bool, dtype) -> dict | None:
    """The table's entry for this product: its own row bucket's, else the nearest larger bucket's
    (a table tuned at 1 and 64 rows serves 8- and 16-row verify blocks and batches with its 64-row
    blocks), else None. On an H200 the rule's blocks at 8 rows made an 8B verify of T = 8 cost 1.18x
    T = 1; the 64-row entry's blocks bring it to 1.00x, and batch-16 decoding 17% (8B) and 30% (1B)
    faster."""
    hit = table.get(tuning_key(M, K, N, transposed, dtype))
    if hit or M == 1:
        return hit
    for rows in TUNED_ROW_BUCKETS:
        if rows > _pad_rows(M) and (hit := table.get(tuning_key(rows, K, N, transposed, dtype))):
            return hit
    return None


def matmul_choice() -> str:
    choice = os.environ.get("JSPEC_MATMUL", "auto")
    if choice not in MATMUL_CHOICES:
        raise ValueError(f"JSPEC_MATMUL={choice!r}: expected one of {', '.join(MATMUL_CHOICES)}")
    return choice


def pick_blocks(M: int, K: int, N: int, *, transposed: bool, dtype=jnp.bfloat16,
                in_place: bool = False) -> Blocks | None:
    """The kernel's blocks for this card and product, or None where XLA's dot is the better choice.

    A table entry (`tuned_entry`; measured by bench_shapes --parts tune) gives the best blocks and
    whether XLA's dot on a weight buffer of its own was faster. `in_place`: the weight is one layer of a stacked
    array, which XLA would first copy out (about 2.3x slower at 8B shapes), so the kernel is used
    whatever XLA's own-buffer time. Without an entry: `default_blocks`, except that XLA's dot
    serves matrices below MIN_ELEMENTS (launch-bound) at more than one row. At one row XLA lowers
    the product to a multiply and a reduction, which lost to the kernel at every small product
    tuned on the H100 (by 1.4-2.6x); a card without a table would pay that in every layer of a
    small model's decode step."""
    choice = matmul_choice()
    if choice == "xla" or M > MAX_ROWS:
        return None
    hit = tuned_entry(_tuning_table(card_name()), M, K, N, transposed, dtype)
    if choice == "auto" and not in_place and (hit.get("xla_faster") if hit else K * N < MIN_ELEMENTS and M > 1):
        return None
    if hit:  # (measured on this card, but maybe at other rows, or before its shared memory was checked)
        return fit_blocks(M, Blocks(*hit["blocks"]), jnp.dtype(dtype).itemsize)
    return default_blocks(M, K, N, transposed=transposed)


def candidate_blocks(M: int, K: int, N: int, *, transposed: bool, sms: int | None = None) -> list[Blocks]:
    """A small search space for tuning (bench_shapes --parts tune): BN x BK x split, 4 stages (3
    where 4 do not fit the card's shared memory, `smem_limit`; left out where 3 do not either);
    splits that give the grid between one and eight programs per SM (and no split)."""
    sms = sms or _sm_count()
    out = []
    bns = (64, 128) if not transposed else (16, 32, 64)
    bks = (128, 256) if not transposed else (256, 512)
    for bn in bns:
        for bk in bks:
            if bk > 1 << (K - 1).bit_length():
                continue
            programs = -(-N // bn)
            for split in (1, 2, 4, 8, 16):
                if split > 1 and (K // split < bk or programs * split > 8 * sms or programs * split // 2 >= 2 * sms):
                    continue
                b = Blocks(bn, bk, split, 4, 4)
                if smem_bytes(M, b) > smem_limit():
                    b = Blocks(bn, bk, split, 4, 3)
                if smem_bytes(M, b) <= smem_limit():
                    out.append(b)
    return out
