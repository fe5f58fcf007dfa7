"""Fused norm + projection kernels for few rows (decode, verify): one kernel per projection.

At batch 1 XLA rewrites every `x @ W` with a single row into an elementwise multiply and a
reduction (its dot strength reduction applies to matrix-vector products under 10M elements). When
the multiply also carries the layer's weight slice and the RMSNorm, it is emitted as its own loop
fusion that writes a weight-sized product to memory (1.1 MB for SmolLM2's QKV) before a second
kernel reduces it. Together with the norms, the residual adds and the activation, a 135M model's
layer spends 11 of its 21 kernels on four matrix products.

These Pallas (Triton) kernels compute, for M <= MAX_ROWS rows, each product in one launch:

    rows(x) = RMSNorm(x) * norm_w     (optional prologue; the full row is loaded once per program)
    out     = rows(x) @ W[layer]      (the stacked [L, K, N] weight is indexed in place: no slice copy)
    out     = act(out_gate) * out_up  (optional: gate and up column blocks of a fused W in one program)
    out     = residual + out          (optional epilogue)

Each rounding step follows the portable path (norm in float32, rounded to the model dtype before
the product; product accumulated in float32 and rounded; residual added after rounding), so the
two agree to bf16 rounding. Grid: one program per block_n output columns; all rows in one tile
(padded to 16 for the tensor cores).

Status (NVIDIA H200, SmolLM2-135M, batch 1): 6 kernels a layer instead of 13, yet a decode step
takes 1.31 / 1.15 / 1.10 ms with blocks (bn, bk, warps, stages) = (32,64,4,3) / (16,128,4,3) /
(16,256,8,3) against 1.04 ms for XLA's matmuls: each program walks K serially with few programs in
flight, so these kernels are latency-bound. Bigger K blocks helped; split-K or a whole-K tile per
program is the next thing to try. Until one wins, model.forward uses them only under "pallas_fused".
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_ROWS = 64  # rows (batch x tokens) handled in one tile; more rows use XLA's GEMMs
DEFAULT_BLOCKS = (32, 64, 4, 3)  # block_n, block_k, num_warps, num_stages


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel(layer_ref, x_ref, norm_ref, w_ref, bias_ref, res_ref, o_ref, *, M, BM, K, BK, BN, N, gate_offset, eps,
            activation):
    n = pl.program_id(0)
    layer = layer_ref[0]
    dt = x_ref.dtype
    rows = pl.ds(0, BM)
    r_ok = (jnp.arange(BM) < M)[:, None]
    precision = lax.Precision.HIGHEST if dt == jnp.float32 else None

    def dot(a, b):
        return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32, precision=precision)

    if norm_ref is not None:
        KP = _next_pow2(K)
        xf = plgpu.load(x_ref.at[rows, pl.ds(0, KP)], mask=r_ok & (jnp.arange(KP) < K)[None, :], other=0)
        xf = xf.astype(jnp.float32)
        inv_rms = lax.rsqrt(jnp.sum(xf * xf, axis=1) / K + eps)  # [BM]

    cols = n * BN + jnp.arange(BN)
    c_ok = (cols < N)[None, :]

    def body(k, accs):
        kb = pl.ds(k * BK, BK)
        k_ok = (k * BK + jnp.arange(BK) < K)
        xb = plgpu.load(x_ref.at[rows, kb], mask=r_ok & k_ok[None, :], other=0)
        if norm_ref is not None:
            w_norm = plgpu.load(norm_ref.at[layer, kb], mask=k_ok, other=0).astype(jnp.float32)
            xb = (xb.astype(jnp.float32) * inv_rms[:, None] * w_norm[None, :]).astype(dt)
        # accs[0]: columns [n*BN, +BN) (the gate when gated); accs[1]: the matching up columns
        w_ok = k_ok[:, None] & c_ok
        out = [accs[0] + dot(xb, plgpu.load(w_ref.at[layer, kb, pl.ds(n * BN, BN)], mask=w_ok, other=0))]
        if gate_offset is not None:
            out.append(accs[1] + dot(xb, plgpu.load(w_ref.at[layer, kb, pl.ds(gate_offset + n * BN, BN)], mask=w_ok,
                                                    other=0)))
        return tuple(out)

    accs = (jnp.zeros((BM, BN), jnp.float32),) * (1 if gate_offset is None else 2)
    accs = lax.fori_loop(0, pl.cdiv(K, BK), body, accs)
    out = accs[0].astype(dt).astype(jnp.float32)
    if bias_ref is not None:
        out = (out + plgpu.load(bias_ref.at[layer, pl.ds(n * BN, BN)], mask=c_ok[0], other=0).astype(jnp.float32)
               [None, :]).astype(dt).astype(jnp.float32)
    if gate_offset is not None:
        up = accs[1].astype(dt).astype(jnp.float32)
        if activation == "silu":
            g = out / (1.0 + jnp.exp(-out))
        else:  # gelu_tanh
            g = 0.5 * out * (1.0 + jnp.tanh(0.7978845608028654 * (out + 0.044715 * out * out * out)))
        out = g.astype(dt).astype(jnp.float32) * up
    if res_ref is not None:
        out = out.astype(dt).astype(jnp.float32) + plgpu.load(res_ref.at[rows, pl.ds(n * BN, BN)], mask=r_ok & c_ok,
                                                              other=0).astype(jnp.float32)
    plgpu.store(o_ref.at[rows, pl.ds(n * BN, BN)], out.astype(o_ref.dtype), mask=r_ok & c_ok)


def block_config() -> tuple[int, int, int, int]:
    """(block_n, block_k, num_warps, num_stages): $JSPEC_PROJ_BLOCKS ("bn,bk,warps,stages") or the default."""
    env = os.environ.get("JSPEC_PROJ_BLOCKS")
    return tuple(int(v) for v in env.split(",")) if env else DEFAULT_BLOCKS


def fused_projection(x, w, layer, *, norm=None, eps=1e-6, bias=None, residual=None, gated=False, activation="silu",
                     interpret=False):
    """[RMSNorm(x) * norm[layer]] @ w[layer] (+ bias[layer]) [-> act(gate) * up] (+ residual).

    x [M, K] (M <= MAX_ROWS); w [L, K, N] stacked over layers (N = 2F when gated: gate columns
    then up columns); norm [L, K]; bias [L, N]; residual [M, N_out]; layer an int32 scalar.
    Returns [M, N_out] in x's dtype (N_out = F when gated, else N).
    """
    M, K = x.shape
    L, K2, N = w.shape
    assert K == K2 and M <= MAX_ROWS, (x.shape, w.shape)
    block_n, block_k, num_warps, num_stages = block_config()
    N_out = N // 2 if gated else N
    BM = max(16, _next_pow2(M))
    kernel = functools.partial(_kernel, M=M, BM=BM, K=K, BK=block_k, BN=block_n, N=N_out,
                               gate_offset=N_out if gated else None, eps=float(eps), activation=activation)
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(N_out, block_n),),
        out_shape=jax.ShapeDtypeStruct((M, N_out), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jspec_projection",
    )(layer, x, norm, w, bias, residual)
