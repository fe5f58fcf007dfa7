"""Decoding speed at real model shapes (random weights), against the memory-bandwidth floor and a
compiled PyTorch peer, side by side in one process.

    python scripts/bench_shapes.py --shapes llama-3.1-8b,llama-3.2-1b --parts ar,verify,draft \
        [--peer PATH/torch_fast_peer.py] [--out DIR]

Parts (each writes rows to <out>/shapes_<card>.json, rewritten after every row so a killed run
keeps what it measured; the committed rows live in benchmarks/shapes/):
  gemm    every projection of a layer and the LM head at 1 / 16 / 64 rows, as XLA's dot on a
          weight buffer of its own ("xla"), the same with cuBLAS instead of Triton GEMMs
          ("xla_cublas"), XLA's dot on a slice of stacked [L, K, N] weights ("xla_stacked", what a
          layer loop over stacked weights runs), and the matvec kernel with its picked blocks
          reading a weight buffer ("matvec") or stacked weights by layer index ("matvec_stacked");
  tune    the matvec kernel's candidate blocks for each product at --tune-rows (1, 16, 32, 64; of
          --products): the best, against the best XLA variant (wo and w_down timed with the
          residual add and RMSNorm that follow them in the model: unsplit blocks let XLA fold the
          add into the norm's kernel). --wide searches BN 16-256, BK 64-512, splits, 2/4/8 warps
          and 2-6 stages in three stages (~60 candidates, about a minute a product; counts
          printed). Writes <out>/matvec_tuning.json;
          --write-tuning also merges each entry into jspec/kernels/matvec_tuning.json as it is
          measured (this card's entry for that product replaced, everything else kept), and the
          parts that run next use it;
  ar      whole jitted generations (jspec.decode.generate_ar_jit: prompt 64 + 256 new tokens) at
          --batches, per --variants: "auto" (the default kernels), "xla" (JSPEC_MATMUL=xla: XLA's
          dots everywhere, the previous default), "cublas" (xla + cuBLAS GEMMs), "portable"
          ($JSPEC_KERNELS=xla: no Pallas kernel, the fused attention included);
  verify  one target forward + LM head over --verify-sizes (default T = 1, 8, 64 tokens and a 60-node
          tree, cursor fixed), per --variants (auto, xla: XLA's dots, portable: no Pallas kernel);
  draft   an EAGLE-3 head at the target's shape (draft vocab 32k): a chain step and a 10-node tree
          level;
  published  a synthetic EAGLE-3 head in the published sharded format at this shape: written,
          imported (the draft's own config: RoPE base 10000) and drafted;
  memory  one generation at batch 64 with a 4,096-slot cache: peak device memory;
  tp      AR at --batches on one device and under tensor parallelism on --mesh (default model=2:
          generate()'s per-head layout under shard_map), in the same process; the mesh rows have
          devices=N, mesh="model=N", speedup_vs_1_device, identical_to_1_device, and a floor
          from the bytes each device reads (its shards). On a 2-GPU host:
              python scripts/bench_shapes.py --shapes llama-3.1-8b --parts tp --batches 1,16
  peer    the PyTorch peer script (--peer), run as a subprocess at the same batches (implied by --peer).
--tp-shards N makes gemm and tune measure one device's products under model=N (Hq/N, Hkv/N heads,
F/N, an untied LM head's V/N columns): the shapes the tp part's kernels run.

Every row has: shape, card, method (ar / torch_compile / verify / draft_step / tree_level / gemm /
tune), batch, devices, mesh, T, tokens_per_s, ms_per_step, hbm_floor_tokens_per_s, weight_bytes,
and the variant. The HBM floor is weight bytes over the card's bandwidth (a decode step must read
every weight once); `floor_fraction` is tokens_per_s over it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jspec import decode as D
from jspec import model as M
from jspec import sharding as S
from jspec.cards import card_key, card_name
from jspec.checkpoint import eagle_format, synthetic
from jspec.config import ModelConfig
from jspec.heads import eagle as H
from jspec.kernels import matvec as MV
from jspec.sampling import Sampling

SHAPES = {
    "smollm2-135m": ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                                tie_word_embeddings=True),
    "llama-3.2-1b": ModelConfig(arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
                                tie_word_embeddings=True),
    # Qwen2.5-Coder-1.5B-Instruct (the qwen2.5-coder-1.5b-instruct preset's shape: q/k/v biases, untied head)
    "qwen2.5-1.5b": ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1000000.0,
                                rms_norm_eps=1e-6, attention_bias=True),
    # its draft model, Qwen2.5-Coder-0.5B-Instruct (qwen2.5-coder-0.5b-instruct: an LM head of its own)
    "qwen2.5-0.5b": ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1000000.0,
                                rms_norm_eps=1e-6, attention_bias=True),
    "llama-3.1-8b": ModelConfig(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0),
    "llama-3.1-70b": ModelConfig(arch="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                                 num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0),
    "qwen3-8b": ModelConfig(arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0,
                            qk_norm=True, rms_norm_eps=1e-6),
    # a few-layer model for checking this script on a CPU
    "tiny": ModelConfig(arch="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True),
}
PEER_SHAPES = {"smollm2-135m": "smollm2", "llama-3.2-1b": "llama1b", "llama-3.1-8b": "llama8b", "qwen2.5-1.5b": "qwen1.5b"}
# Datasheet HBM bandwidth, bytes/s (the floor's denominator)
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}
PROMPT, NEW = 64, 256
INTERPRET = jax.default_backend() != "gpu"  # the matvec kernel off a GPU: Pallas interpret mode (checks, not timings)


def bandwidth() -> float | None:
    kind = card_name()
    return next((bw for name, bw in BANDWIDTH.items() if name in kind), None)


def weight_bytes(params) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params)))


def random_params(cfg: ModelConfig, dtype=jnp.bfloat16):
    """Random weights made on the device in the serving dtype (no float32 copy of an 8B model)."""
    shapes = jax.eval_shape(lambda k: M.init_params(cfg, k, dtype), jax.random.PRNGKey(0))
    leaves, tree = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
    out = []
    for k, s in zip(keys, leaves):
        make = jax.jit(lambda k, shape=s.shape, dt=s.dtype: (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dt))
        out.append(make(k))
    params = jax.tree.unflatten(tree, out)
    # norms at one, as a real checkpoint's are near
    params["final_norm"] = jnp.ones_like(params["final_norm"])
    for n in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
        if n in params["layers"]:
            params["layers"][n] = jnp.ones_like(params["layers"][n])
    return params


def random_eagle3_head(cfg: ModelConfig):
    """An EAGLE-3 head at the target's shape (draft vocabulary 32k), random, bfloat16: (config, params)."""
    hcfg = H.default_head_config("eagle3", cfg, draft_vocab_size=min(32000, cfg.vocab_size))
    head = jax.jit(lambda k: jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a,
                                          H.init_head(hcfg, k, jnp.float32)))(jax.random.PRNGKey(5))
    return hcfg, head


class Rows:
    def __init__(self, path: Path):
        self.path, self.rows = path, []

    def add(self, **row):
        self.rows.append(row)
        self.path.write_text(json.dumps(self.rows, indent=1))
        print(json.dumps(row), flush=True)


def base_row(shape, cfg, wbytes, method, batch, T, seconds_per_step, tokens_per_step, devices=1, mesh=None,
             device_bytes=None, **extra):
    """A result row. On a mesh, `device_bytes` is what each device reads per step (its shards):
    the floor is that over one card's bandwidth, since the devices stream their shards at once."""
    bw = bandwidth()
    tps = tokens_per_step / seconds_per_step
    floor = bw / (device_bytes or wbytes) * batch if bw else None  # every row of a batch rides one pass over the weights
    if os.environ.get("XLA_FLAGS"):  # A/B runs of XLA flags (one process each) say which they ran
        extra = {"xla_flags": os.environ["XLA_FLAGS"], **extra}
    return dict(shape=shape, card=card_name(), method=method, batch=batch, devices=devices, mesh=mesh, T=T,
                tokens_per_s=round(tps, 1), ms_per_step=round(1000 * seconds_per_step, 4),
                hbm_floor_tokens_per_s=None if floor is None else round(floor, 1),
                floor_fraction=None if floor is None else round(tps / floor, 3), weight_bytes=wbytes, **extra)


def median_time(f, *args, reps=5):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)), float(np.max(ts) - np.min(ts))


def with_matmul(choice: str):
    """JSPEC_MATMUL for the programs traced next (read at trace time; fresh jits per variant)."""
    os.environ["JSPEC_MATMUL"] = choice


# ---------------------------------------------------------------------------------------------
# gemm / tune
# ---------------------------------------------------------------------------------------------


def layer_products(cfg: ModelConfig, order=None):
    """(name, K, N, transposed) of each product of a decode step (on one device of model=N tensor
    parallelism for a per-device config: an untied LM head then holds V/N columns)."""
    qkv = cfg.q_size + 2 * cfg.kv_size
    shards = cfg.tensor_parallel_shards
    out = [("wqkv", cfg.hidden_size, qkv, False), ("wo", cfg.q_size, cfg.hidden_size, False),
           ("w_gate_up", cfg.hidden_size, 2 * cfg.intermediate_size, False),
           ("w_down", cfg.intermediate_size, cfg.hidden_size, False)]
    if cfg.tie_word_embeddings:
        out.append(("lm_head", cfg.hidden_size, cfg.vocab_size, True))
    else:
        vocab = cfg.vocab_size // shards if cfg.vocab_size % shards == 0 else cfg.vocab_size
        out.append(("lm_head", cfg.hidden_size, vocab, False))
    if order:
        out.sort(key=lambda p: order.index(p[0]) if p[0] in order else len(order))
    return out


def copies_for(nbytes: int) -> int:
    """Distinct weight buffers to cycle through so the L2 (50 MB) holds none of them."""
    return int(min(32, max(2, -(-256 * 2**20 // nbytes))))


def product_timer(x, ws, fn, n_iter, compiler_options=None):
    """Seconds per product: n_iter passes over len(ws) weights in one jitted loop."""

    def run(x, ws):
        def body(i, x):
            acc = jnp.zeros((), jnp.float32)
            for w in ws:
                acc = acc + fn(x, w)[..., :1].astype(jnp.float32).sum()
            return x + (acc * 1e-30).astype(x.dtype)  # a dependence, so no pass is hoisted

        return jax.lax.fori_loop(0, n_iter, body, x)

    f = jax.jit(run, compiler_options=compiler_options) if compiler_options else jax.jit(run)
    t, spread = median_time(f, x, ws)
    return t / (n_iter * len(ws)), spread / (n_iter * len(ws))


WIDE_BN, WIDE_BK = (16, 32, 64, 128, 256), (64, 128, 256, 512)
WIDE_SPLITS, WIDE_WARPS, WIDE_STAGES = (1, 2, 4, 8, 16, 32), (2, 4, 8), (2, 3, 4, 5, 6)
SPLITS_PER_TILE = 4  # the first stage's splits per BN: those whose grid is nearest 4 programs per SM


def _fits(m, b: MV.Blocks) -> bool:
    return MV.smem_bytes(m, b) <= MV.smem_limit() and b[0] * b[1] <= 256 * 256  # larger W tiles spill registers


def wide_search(m, K, N, tr, time_blocks, sms=None, log=print):
    """--wide: a coordinate search over BN 16-256, BK 64-512, split 1-32, 2/4/8 warps, 2-6 stages,
    tensor or CUDA cores, timing about 60 candidates a product (about a minute on a GPU) instead
    of all ~3,600:
      1. BN x split at BK 128 (256 for an [N, K] weight), 4 warps, 4 stages; the splits kept per BN
         are the SPLITS_PER_TILE whose grid is nearest 4 programs per SM, between half a program
         and 16 per SM (a grid smaller than the card keeps split 1), each split at least a tile;
         1b. at one row, the best four of those multiplying and summing on the CUDA cores (fma);
      2. the best two so far at every BK x stages that fits shared memory;
      3. the best two so far at 2 and 8 warps.
    time_blocks(b) -> seconds, or None where Triton rejects the blocks. Returns {blocks: seconds}."""
    sms = sms or MV._sm_count()
    bk0 = min(256 if tr else 128, max(64, 1 << (K - 1).bit_length()))
    results: dict = {}

    def run(cands, label):
        cands = [b for b in dict.fromkeys(cands) if b not in results and _fits(m, b)]
        t0 = time.perf_counter()
        for b in cands:
            results[b] = time_blocks(b)
        log(f"  {label}: {len(cands)} candidates, {time.perf_counter() - t0:.1f} s", flush=True)

    def best(k):
        return [b for _, b in sorted((t, b) for b, t in results.items() if t is not None)[:k]]

    first = []
    for bn in WIDE_BN:
        if bn > max(16, 1 << (N - 1).bit_length()):
            continue
        grid = -(-N // bn)
        ok = [sp for sp in WIDE_SPLITS if (sp == 1 or K // sp >= bk0) and sms // 2 <= grid * sp <= 16 * sms]
        if not ok:
            ok = [1]  # a grid smaller than half the card even unsplit: a small product
        ok.sort(key=lambda sp: abs(np.log2(grid * sp / (4 * sms))))
        first += [MV.Blocks(bn, bk0, sp, 4, 4) for sp in ok[:SPLITS_PER_TILE]]
    name = f"{m}x{K}x{N}{'t' if tr else ''}"
    run(first, f"wide tune {name}, 1 (BN x split)")
    if m == 1:
        run([MV.Blocks(*b[:5], fma=1) for b in best(4)], "1b (the best 4 on the CUDA cores: multiply and sum)")
    run([MV.Blocks(b[0], bk, b[2], 4, st, fma=b.fma) for b in best(2) for bk in WIDE_BK
         if bk <= max(64, 1 << (K - 1).bit_length()) and (b[2] == 1 or K // b[2] >= bk) for st in WIDE_STAGES],
        "2 (BK x stages of the best 2)")
    run([MV.Blocks(*b[:3], w, b[4], fma=b.fma) for b in best(2) for w in WIDE_WARPS], "3 (warps of the best 2)")
    return results


def search_blocks(m, K, N, tr, time_blocks, wide: bool, log=print):
    """The best blocks for one product: MV.candidate_blocks' small set, or `wide_search`. Returns
    (seconds, blocks, candidates timed), or None if every candidate failed."""
    if wide:
        results = wide_search(m, K, N, tr, time_blocks, log=log)
    else:
        cands = MV.candidate_blocks(m, K, N, transposed=tr)
        results = {b: time_blocks(b) for b in cands}
        log(f"  tune {m}x{K}x{N}{'t' if tr else ''}: {len(cands)} candidates", flush=True)
    ranked = sorted((t, b) for b, t in results.items() if t is not None)
    return (*ranked[0], len(results)) if ranked else None


MAX_REL_ERR = 2e-2  # a tuning candidate whose product is further from XLA's (bf16 inputs) is rejected
RESIDUAL_PRODUCTS = ("wo", "w_down")  # their results go into the residual stream, then an RMSNorm


def residual_and_norm(m, N):
    """What the model does with wo's / w_down's [m, N] result: add it to the residual stream, then
    RMSNorm the sum (the next product's input)."""
    h = (0.1 * jax.random.normal(jax.random.PRNGKey(11), (m, N), jnp.float32)).astype(jnp.bfloat16)
    ones = jnp.ones((N,), jnp.bfloat16)
    return lambda y: M.rms_norm(h + y.astype(h.dtype), ones, 1e-5)


def gemm_part(shape, cfg, rows_out: Rows, row_counts=(1, 16, 64), tune=False, tuning=None, wide=False,
              products=None, tune_rows=(1, 64), write=False):
    dtype = jnp.bfloat16
    bw = bandwidth()
    for name, K, N, tr in layer_products(cfg, products):  # --products' order: a time-limited run does those first
        if products and name not in products:
            continue
        nbytes = K * N * 2
        R = copies_for(nbytes) if not INTERPRET else 2  # (a CPU check of this script: few, short loops)
        key = jax.random.PRNGKey(hash(name) & 0xFFFF)
        wshape = (N, K) if tr else (K, N)
        stacked = (0.02 * jax.random.normal(key, (R, *wshape), jnp.float32)).astype(dtype)
        ws = [stacked[i] + 0 for i in range(R)]  # buffers of their own
        jax.block_until_ready(ws)
        n_iter = max(2, int(2e9 // (nbytes * R))) if not INTERPRET else 2
        for m in row_counts:
            x = (jax.random.normal(jax.random.PRNGKey(m), (m, K), jnp.float32)).astype(dtype)
            xla_dot = lambda x, w: jnp.dot(x, w.T if tr else w, preferred_element_type=jnp.float32)  # noqa: E731
            variants = {"xla": (xla_dot, None), "xla_cublas": (xla_dot, {"xla_gpu_enable_triton_gemm": False})}
            blocks = MV.pick_blocks(m, K, N, transposed=tr) or MV.default_blocks(m, K, N, transposed=tr)
            variants["matvec"] = (lambda x, w, b=blocks: MV.matvec(x, w, transposed=tr, blocks=b,
                                                                    out_dtype=jnp.float32, interpret=INTERPRET), None)
            ref = np.asarray(jnp.dot(x, ws[0].T if tr else ws[0], preferred_element_type=jnp.float32))
            try:
                got = np.asarray(variants["matvec"][0](x, ws[0]))
                rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            except Exception as e:  # noqa: BLE001
                rel = repr(e)[:300]
            rows_out.add(shape=shape, card=card_name(), method="gemm_check", product=name, rows=m, rel_err_vs_xla=rel)
            results = {}
            for vname, (fn, opts) in variants.items():
                try:
                    t, spread = product_timer(x, ws, fn, n_iter, opts)
                    results[vname] = t
                    rows_out.add(shape=shape, card=card_name(), method="gemm", variant=vname, product=name, K=K, N=N,
                                 transposed=tr, rows=m, us=round(1e6 * t, 2), spread_us=round(1e6 * spread, 2),
                                 gbps=round(nbytes / t / 1e9, 1),
                                 bw_fraction=None if not bw else round(nbytes / t / bw, 3),
                                 blocks=list(blocks) if vname == "matvec" else None)
                except Exception as e:  # noqa: BLE001 - record and go on
                    rows_out.add(shape=shape, card=card_name(), method="gemm", variant=vname, product=name, rows=m,
                                 error=repr(e)[:300])
            # stacked: a static layer slice inside the jit (what a loop over stacked weights does)
            if not tr and not (tune and wide):  # (diagnostic rows: a wide tuning run skips them)
                for vname, fn in (("xla_stacked", lambda x, st, i: x @ st[i]),
                                  ("matvec_stacked", lambda x, st, i, b=blocks: MV.matvec(x, st, layer=i, blocks=b,
                                                                                        interpret=INTERPRET))):
                    try:
                        def run(x, st, fn=fn):
                            def body(j, x):
                                acc = jnp.zeros((), jnp.float32)
                                for i in range(R):
                                    acc = acc + fn(x, st, i)[..., :1].astype(jnp.float32).sum()
                                return x + (acc * 1e-30).astype(x.dtype)
                            return jax.lax.fori_loop(0, n_iter, body, x)
                        t, spread = median_time(jax.jit(run), x, stacked)
                        t /= n_iter * R
                        rows_out.add(shape=shape, card=card_name(), method="gemm", variant=vname, product=name, K=K, N=N,
                                     transposed=tr, rows=m, us=round(1e6 * t, 2), gbps=round(nbytes / t / 1e9, 1),
                                     bw_fraction=None if not bw else round(nbytes / t / bw, 3))
                    except Exception as e:  # noqa: BLE001
                        rows_out.add(shape=shape, card=card_name(), method="gemm", variant=vname, product=name, rows=m,
                                     error=repr(e)[:300])
            if tune and m in tune_rows:
                # wo's and w_down's results meet the residual and the next RMSNorm in an XLA fusion:
                # timed with it, since unsplit blocks let XLA fold the add into the norm's kernel
                # while split ones leave a summing kernel before it
                then = residual_and_norm(m, N) if name in RESIDUAL_PRODUCTS else (lambda y: y)
                best_xla = None
                for vname, opts in (("xla", None), ("xla_cublas", {"xla_gpu_enable_triton_gemm": False})):
                    if name in RESIDUAL_PRODUCTS:  # XLA's dots with the same epilogue
                        try:
                            t = product_timer(x, ws, lambda x, w: then(jnp.dot(x, w)), n_iter, opts)[0]
                        except Exception:  # noqa: BLE001
                            continue
                    else:
                        t = results.get(vname)
                    if t is not None and (best_xla is None or t < best_xla):
                        best_xla = t

                def time_blocks(b):
                    try:
                        got = np.asarray(MV.matvec(x, ws[0], transposed=tr, blocks=b, out_dtype=jnp.float32,
                                                   interpret=INTERPRET))
                        if not np.linalg.norm(got - ref) <= MAX_REL_ERR * np.linalg.norm(ref):
                            print(f"  {list(b)}: wrong result, skipped", flush=True)
                            return None
                        return product_timer(x, ws, lambda x, w, b=b: then(MV.matvec(
                            x, w, transposed=tr, blocks=b, out_dtype=jnp.float32 if name not in RESIDUAL_PRODUCTS
                            else None, interpret=INTERPRET)), n_iter)[0]
                    except Exception:  # noqa: BLE001 - a block shape Triton rejects
                        return None

                found = search_blocks(m, K, N, tr, time_blocks, wide)
                if found is None:
                    continue
                best_t, best_b, searched = found
                entry = {"blocks": list(best_b), "matvec_us": round(1e6 * best_t, 2),
                         "xla_us": None if best_xla is None else round(1e6 * best_xla, 2),
                         "xla_faster": best_xla is not None and best_xla < best_t, "searched": searched}
                if name in RESIDUAL_PRODUCTS:
                    entry["timed_with"] = "residual add + RMSNorm"
                tuning[MV.tuning_key(m, K, N, tr, dtype)] = entry
                if write:  # entry by entry, so a run cut off by a time limit keeps what it tuned
                    write_tuning({MV.tuning_key(m, K, N, tr, dtype): entry})
                rows_out.add(shape=shape, card=card_name(), method="tune", product=name, K=K, N=N, transposed=tr, rows=m,
                             best_blocks=list(best_b), matvec_us=round(1e6 * best_t, 2), searched=searched,
                             xla_us=None if best_xla is None else round(1e6 * best_xla, 2),
                             bw_fraction=None if not bw else round(nbytes / best_t / bw, 3),
                             **{k: v for k, v in entry.items() if k.startswith("timed")})
        del stacked, ws


# ---------------------------------------------------------------------------------------------
# ar / verify / draft
# ---------------------------------------------------------------------------------------------


def ar_part(shape, cfg, params, rows_out: Rows, batches, variants):
    wbytes = weight_bytes(params)
    sampling = Sampling()
    for variant in variants:
        jax.clear_caches()  # JSPEC_MATMUL is read when tracing: each variant must trace anew
        with_kernels(variant)
        opts = {"xla_gpu_enable_triton_gemm": False} if variant == "cublas" else None
        gen = jax.jit(D.generate_ar_jit.__wrapped__,
                      static_argnames=("cfg", "max_new", "cache_len", "sampling", "unroll"),
                      **({"compiler_options": opts} if opts else {}))
        for b in batches:
            try:
                toks = jax.random.randint(jax.random.PRNGKey(b), (b, PROMPT), 0, cfg.vocab_size).astype(jnp.int32)
                lens = jnp.full((b,), PROMPT, jnp.int32)
                cache_len = D.plan_cache_len(D.bucket(PROMPT), NEW)
                run = lambda: gen(params, cfg, toks, lens, jax.random.PRNGKey(0), max_new=NEW, cache_len=cache_len,
                                  sampling=sampling)
                t0 = time.perf_counter()
                jax.block_until_ready(run())
                compile_s = time.perf_counter() - t0
                t, spread = median_time(lambda: run(), reps=3)
                rows_out.add(**base_row(shape, cfg, wbytes, "ar", b, 1, t / NEW, b, variant=variant,
                                        spread_ms=round(1000 * spread, 2), compile_s=round(compile_s, 1),
                                        note="whole generation: prompt 64 + 256 new tokens; ms_per_step = time / 256"))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rows_out.add(shape=shape, card=card_name(), method="ar", variant=variant, batch=b, error=repr(e)[:300])
    with_kernels("auto")


def tp_part(shape, cfg, params, rows_out: Rows, batches, mesh_spec: str):
    """AR (prompt 64 + 256 new tokens) on one device and under tensor parallelism on `mesh_spec`
    (generate()'s path: per-head layout, shard_map, the one-device kernels on every device), in
    the same process, at each batch. The mesh rows carry speedup_vs_1_device and whether their
    greedy tokens equal the one-device run's (in bf16 the split sums round differently, so a
    random-weight model's near-ties may flip; float32 identity is what the CPU tests check)."""
    mesh = S.parse_mesh(mesh_spec)
    n = S.axis_size(mesh, "model")
    local = S.tensor_parallel_config(cfg, n)
    wbytes, sampling = weight_bytes(params), Sampling()
    cache_len = D.plan_cache_len(D.bucket(PROMPT), NEW)
    placed = S.place_tensor_parallel(params, cfg, mesh)
    device_bytes = int(sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(placed)))
    specs = S.tensor_parallel_specs(params, cfg, n)
    with M.per_device_program():  # GPU kernels on a host with several GPUs: each program runs whole per device
        for b in batches:
            toks = jax.random.randint(jax.random.PRNGKey(b), (b, PROMPT), 0, cfg.vocab_size).astype(jnp.int32)
            lens = jnp.full((b,), PROMPT, jnp.int32)
            common = dict(max_new=NEW, cache_len=cache_len, sampling=sampling)
            tp = S.tensor_parallel_map(D.generate_ar_jit, mesh, "params", specs,
                                       tuple(sorted(dict(cfg=local, **common).items())))
            runs = (("1 device", lambda: D.generate_ar_jit(params, cfg, toks, lens, jax.random.PRNGKey(0), **common),
                     1, None, None),
                    (mesh_spec, lambda: tp(placed, dict(tokens=toks, lens=lens, key=jax.random.PRNGKey(0))),
                     n, mesh_spec, device_bytes))
            base_t = base_out = None
            for label, run, devices, mesh_name, dbytes in runs:
                try:
                    t0 = time.perf_counter()
                    out = jax.device_get(run()[0])
                    compile_s = time.perf_counter() - t0
                    t, spread = median_time(lambda: run(), reps=3)
                    extra = {}
                    if base_t is not None:
                        extra = dict(speedup_vs_1_device=round(base_t / t, 3),
                                     identical_to_1_device=bool(np.array_equal(out, base_out)))
                    else:
                        base_t, base_out = t, out
                    rows_out.add(**base_row(shape, cfg, wbytes, "ar", b, 1, t / NEW, b, devices=devices, mesh=mesh_name,
                                            device_bytes=dbytes, variant="auto", part="tp",
                                            spread_ms=round(1000 * spread, 2), compile_s=round(compile_s, 1),
                                            note=f"whole generation, {label}: prompt 64 + 256 new tokens; "
                                                 "ms_per_step = time / 256", **extra))
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    rows_out.add(shape=shape, card=card_name(), method="ar", part="tp", batch=b, devices=devices,
                                 mesh=mesh_name, error=repr(e)[:300])
    del placed


def filled_cache(params, cfg, batch, committed=192, cache_len=640):
    cache = M.init_cache(cfg, batch, cache_len, params["embed"].dtype)
    toks = jax.random.randint(jax.random.PRNGKey(1), (batch, committed), 0, cfg.vocab_size)
    cache = jax.jit(lambda p, t, c: M.forward(p, cfg, t, c, kernels="xla", unroll=1).cache)(params, toks, cache)
    return cache.replace(lengths=jnp.full((batch,), committed, jnp.int32))


def tree_mask(T, batch, seed=0):
    rng = np.random.RandomState(seed)
    parent = [-1] + [int(rng.randint(max(0, i - 10), i)) for i in range(1, T)]
    anc = np.zeros((T, T), bool)
    for i in range(T):
        j = i
        while j >= 0:
            anc[i, j], j = True, parent[j]
    return jnp.asarray(np.broadcast_to(anc, (batch, T, T))), jnp.asarray(anc.sum(1) - 1, jnp.int32)


VERIFY_SIZES = "1,8,64,tree60"


def parse_verify_sizes(text: str) -> list[tuple[int, bool]]:
    """--verify-sizes: comma-separated token counts, `treeN` for an N-node tree; (T, is_tree) each."""
    sizes = []
    for item in text.split(","):
        item = item.strip()
        tree = item.startswith("tree")
        digits = item[4:] if tree else item
        if not digits.isdigit() or not 1 <= int(digits) <= 64:
            raise ValueError(f"--verify-sizes: {item!r} is not a token count or treeN with 1 <= N <= 64")
        sizes.append((int(digits), tree))
    return sizes


def with_kernels(variant: str):
    """The kernels a verify or AR variant traces with: "auto" (every fast path), "xla" / "cublas"
    (XLA's dots, the fused attention kept), "portable" (no Pallas kernel at all: $JSPEC_KERNELS=xla)."""
    with_matmul("xla" if variant in ("xla", "cublas") else "auto")
    if variant == "portable":
        os.environ["JSPEC_KERNELS"] = "xla"
    else:
        os.environ.pop("JSPEC_KERNELS", None)


def verify_part(shape, cfg, params, rows_out: Rows, batch=1, n=20, sizes=None, variants=("auto",)):
    """One target forward + LM head per call at each size, per variant: where a tree's verify cost
    steps up with its size, and which kernel it comes from."""
    wbytes = weight_bytes(params)
    cache = filled_cache(params, cfg, batch)
    for variant in variants:
        jax.clear_caches()  # the kernel choices are read when tracing
        with_kernels(variant)
        one_token = None  # this variant's T = 1 time, where the sizes start with it
        for T, is_tree in sizes or parse_verify_sizes(VERIFY_SIZES):
            mask, depth = tree_mask(T, batch) if is_tree else (None, None)
            pos = cache.lengths[:, None] + (jnp.arange(T, dtype=jnp.int32)[None] if depth is None else depth[None])

            def run(params, cache, toks, mask=mask, pos=pos):
                def body(i, c):
                    cache, toks = c
                    out = M.forward(params, cfg, toks, cache, positions=pos, new_mask=mask)
                    return out.cache, jnp.argmax(M.lm_head(params, cfg, out.hidden), -1).astype(jnp.int32)
                return jax.lax.fori_loop(0, n, body, (cache, toks))

            toks = jnp.zeros((batch, T), jnp.int32)
            t, spread = median_time(jax.jit(run), params, cache, toks)
            t /= n
            if (T, is_tree) == (1, False):
                one_token = t
            rows_out.add(**base_row(shape, cfg, wbytes, "verify", batch, T, t, batch, tree=is_tree, variant=variant,
                                    vs_T1=round(t / one_token, 3) if one_token else None,
                                    spread_ms=round(1000 * spread / n, 3),
                                    note="one target forward + LM head on all T tokens; tokens_per_s counts one token a call"))
    with_kernels("auto")


def draft_part(shape, cfg, params, rows_out: Rows, batch=1, n=50, head_and_config=None, variant="jspec"):
    if head_and_config is None:
        hcfg, head = random_eagle3_head(cfg)
    else:
        hcfg, head = head_and_config
    hbytes = weight_bytes({k: v for k, v in head.items() if k != "d2t"})
    cache = H.init_head_cache(hcfg, batch, 640, jnp.bfloat16).replace(lengths=jnp.full((batch,), 192, jnp.int32))
    feats = jnp.zeros((batch, 1, cfg.hidden_size), jnp.bfloat16)

    def chain(head, params, cache, tok):
        def body(i, c):
            cache, tok, f = c
            h, logits, cache2 = H.head_chain_step(hcfg, head, params, tok, f, cache)
            return cache, jnp.argmax(logits, -1).astype(jnp.int32), h.astype(f.dtype)
        return jax.lax.fori_loop(0, n, body, (cache, tok, feats))

    t, spread = median_time(jax.jit(chain), head, params, cache, jnp.zeros((batch, 1), jnp.int32))
    rows_out.add(**base_row(shape, cfg, hbytes, "draft_step", batch, 1, t / n, batch, head_bytes=hbytes, variant=variant,
                            note="EAGLE-3 head chain step (draft vocab 32k); floor = head bytes / bandwidth"))
    T = 10
    fused = H.fused_head_attention(hcfg, 2 * T)
    pos = cache.lengths[:, None] + jnp.zeros((1, T), jnp.int32)

    def level(head, params, cache, tok):
        def body(i, c):
            cache, tok = c
            h, logits, entries, cache = H.head_tree_level(hcfg, head, params, tok, jnp.zeros((batch, T, cfg.hidden_size),
                                                          jnp.bfloat16), cache, pos, None,
                                                          jnp.ones((batch, T, 0), bool), fused=fused)
            return cache, jnp.argmax(logits, -1).astype(jnp.int32)
        return jax.lax.fori_loop(0, n, body, (cache, tok))

    t, spread = median_time(jax.jit(level), head, params, cache, jnp.zeros((batch, T), jnp.int32))
    rows_out.add(**base_row(shape, cfg, hbytes, "tree_level", batch, T, t / n, batch, head_bytes=hbytes, variant=variant,
                            note="EAGLE-3 head tree level of 10 frontier nodes"))


def published_part(shape, cfg, params, rows_out: Rows, workdir: Path):
    """A synthetic EAGLE-3 head in the published (SpecForge / EAGLE) format at this target's shape,
    sharded safetensors without rope_theta: written, imported with the draft's own config, drafted."""

    path = Path(tempfile.mkdtemp(dir=workdir))
    try:
        t0 = time.perf_counter()
        synthetic.write_published_eagle3_head(str(path), cfg, layout="sharded", draft_vocab_size=min(32000, cfg.vocab_size))
        t1 = time.perf_counter()
        hcfg, head = eagle_format.load_eagle_head(str(path), cfg, dtype=jnp.bfloat16)
        head = jax.device_put(head)
        jax.block_until_ready(head)
        t2 = time.perf_counter()
        rows_out.add(shape=shape, card=card_name(), method="published_head_load", write_s=round(t1 - t0, 1),
                     load_s=round(t2 - t1, 1), head_rope_theta=hcfg.rope_theta if hasattr(hcfg, "rope_theta") else None,
                     capture_layers=list(hcfg.capture_layers))
        draft_part(shape, cfg, params, rows_out, head_and_config=(hcfg, head), variant="published")
    finally:
        shutil.rmtree(path, ignore_errors=True)


def memory_part(shape, cfg, params, rows_out: Rows, batch=64, context=4096):
    """One generation at `batch` rows filling a `context`-slot cache (a prompt of context - NEW
    tokens, run by the chunked prefill, then NEW tokens): peak device memory."""
    wbytes = weight_bytes(params)
    prompt = context - NEW
    toks = jax.random.randint(jax.random.PRNGKey(3), (batch, prompt), 0, cfg.vocab_size).astype(jnp.int32)
    lens = jnp.full((batch,), prompt, jnp.int32)
    gen = jax.jit(D.generate_ar_jit.__wrapped__, static_argnames=("cfg", "max_new", "cache_len", "sampling", "unroll"))
    run = lambda: gen(params, cfg, toks, lens, jax.random.PRNGKey(0), max_new=NEW, cache_len=context,
                      sampling=Sampling())
    jax.block_until_ready(run())
    t0 = time.perf_counter()
    jax.block_until_ready(run())
    t = time.perf_counter() - t0
    stats = jax.devices()[0].memory_stats() or {}
    rows_out.add(shape=shape, card=card_name(), method="memory", batch=batch, context=context, weight_bytes=wbytes,
                 peak_bytes=stats.get("peak_bytes_in_use"), bytes_limit=stats.get("bytes_limit"),
                 seconds=round(t, 2), tokens_per_s=round(batch * NEW / t, 1),
                 note=f"prompt {prompt} + {NEW} new tokens per row in a {context}-slot cache; time includes the prefill")


def peer_part(shape, cfg, peer: str, batches, rows_out: Rows, out_dir: Path):
    """The compiled PyTorch peer at this shape and these batches, as `torch_compile` rows (a subprocess
    on the same GPU; main() keeps JAX from preallocating the GPU's memory when this part runs)."""
    name = PEER_SHAPES.get(shape)
    if not name:
        return
    env = {**os.environ, "OUT": str(out_dir)}
    cmd = [sys.executable, peer, "--shape", name, "--modes", "compile", "--batches", ",".join(map(str, batches)),
           "--new", str(NEW), "--prompt", str(PROMPT)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    print(proc.stdout[-3000:], proc.stderr[-2000:], flush=True)
    js = out_dir / f"torch_fast_peer_{name}.json"
    if not js.exists():
        rows_out.add(shape=shape, card=card_name(), method="torch_compile", error=(proc.stderr or proc.stdout)[-300:])
        return
    wbytes = weight_bytes(jax.eval_shape(lambda k: M.init_params(cfg, k, jnp.bfloat16), jax.random.PRNGKey(0)))
    for r in json.loads(js.read_text()):
        rows_out.add(**base_row(shape, cfg, wbytes, "torch_compile", r["batch"], 1, r["ms_per_step"] / 1000, r["batch"],
                                note="PyTorch peer (static KV cache, torch.compile reduce-overhead), same GPU, same run"))


def write_tuning(tuning: dict, path: Path = MV.TUNING_FILE):
    """Merge this card's tuned entries into the kernel's table (other cards' and other products'
    entries kept); the programs traced next read it."""
    table = json.loads(path.read_text()) if path.exists() else {}
    table.setdefault(card_name(), {}).update(tuning)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    MV._tuning_table.cache_clear()
    print(f"merged {len(tuning)} entries for {card_name()} into {path}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama-3.1-8b,llama-3.2-1b,smollm2-135m")
    ap.add_argument("--parts", default="ar,verify,draft")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--variants", default="auto,xla", help="ar and verify variants: auto, xla, cublas, portable")
    ap.add_argument("--verify-sizes", default=VERIFY_SIZES,
                    help="the verify part's sizes: token counts and treeN (an N-node tree), each at most 64")
    ap.add_argument("--peer", default=None, help="path of the PyTorch peer script (torch_fast_peer.py); its rows "
                                                 "join every shape's, whatever --parts says")
    ap.add_argument("--out", default=os.environ.get("OUT", "shape-results"))
    ap.add_argument("--wide", action="store_true",
                    help="tune over a broader block search (BN 16-256, BK 64-512, splits, 2/4/8 warps, 2-6 stages, "
                         "tensor or CUDA cores)")
    ap.add_argument("--tune-rows", default="1,64", help="row counts to tune (each of 1, 16, 32, 64)")
    ap.add_argument("--products", default="",
                    help="gemm/tune only these products, in this order (wqkv,wo,w_gate_up,w_down,lm_head)")
    ap.add_argument("--write-tuning", action="store_true",
                    help="merge the tuning into jspec/kernels/matvec_tuning.json (this card's entries; others kept)")
    ap.add_argument("--mesh", default="model=2", help="the tp part's mesh (tensor parallelism: model=N)")
    ap.add_argument("--tp-shards", type=int, default=1,
                    help="gemm/tune: the per-device products of model=N tensor parallelism (tune them for the tp part)")
    args = ap.parse_args(argv)
    for s in args.shapes.split(","):
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}: expected one of {', '.join(SHAPES)}")
    parts = set(args.parts.split(","))
    if args.peer:  # naming the peer's script is asking for its rows
        parts.add("peer")
    elif "peer" in parts:
        ap.error("--parts peer needs --peer PATH (the PyTorch peer script, torch_fast_peer.py)")
    if "peer" in parts:  # the peer runs beside this process on the same GPU: JAX takes memory as it needs it
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    unknown = set(args.variants.split(",")) - {"auto", "xla", "cublas", "portable"}
    if unknown:
        ap.error(f"--variants: unknown {', '.join(sorted(unknown))}; expected some of auto, xla, cublas, portable")
    try:
        verify_sizes = parse_verify_sizes(args.verify_sizes)
    except ValueError as e:
        ap.error(str(e))
    tune_rows = tuple(int(r) for r in args.tune_rows.split(",") if r.strip().isdigit())
    if not tune_rows or set(tune_rows) - {1, *MV.TUNED_ROW_BUCKETS}:
        ap.error(f"--tune-rows {args.tune_rows!r}: expected a comma-separated subset of 1, 16, 32, 64")
    products = args.products.split(",") if args.products else None
    known = {"wqkv", "wo", "w_gate_up", "w_down", "lm_head"}
    if products and set(products) - known:
        ap.error(f"--products {args.products!r}: expected some of {', '.join(sorted(known))}")
    if args.tp_shards > 1:
        for s in args.shapes.split(","):
            try:
                S.check_tensor_parallel(SHAPES[s], args.tp_shards)
            except ValueError as e:
                ap.error(f"--tp-shards {args.tp_shards}: {s}: {e}")
    if "tp" in parts:  # a bad --mesh fails here, before any weights are made
        try:
            mesh = S.parse_mesh(args.mesh)
        except ValueError as e:
            ap.error(str(e))
        if S.axis_size(mesh, "data") > 1 or S.axis_size(mesh, "model") < 2:
            ap.error(f"--mesh {args.mesh!r}: the tp part measures tensor parallelism: model=N with N >= 2")
        for s in args.shapes.split(","):
            try:
                S.check_tensor_parallel(SHAPES[s], S.axis_size(mesh, "model"))
            except ValueError as e:
                ap.error(f"{s}: {e}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = card_key()
    rows = Rows(out_dir / f"shapes_{tag}.json")
    batches = [int(b) for b in args.batches.split(",")]
    tuning: dict = {}
    print(f"card {card_name()}  jax {jax.__version__}  bandwidth {bandwidth()}", flush=True)
    for shape in args.shapes.split(","):
        cfg = SHAPES[shape]
        if parts & {"gemm", "tune"}:
            gemm_shape = shape if args.tp_shards == 1 else f"{shape} (one device of model={args.tp_shards})"
            gemm_part(gemm_shape, S.tensor_parallel_config(cfg, args.tp_shards), rows,
                      row_counts=tune_rows if args.wide else (1, 16, 64), tune="tune" in parts, tuning=tuning,
                      wide=args.wide, products=products, tune_rows=tune_rows, write=args.write_tuning)
            if tuning:
                (out_dir / "matvec_tuning.json").write_text(json.dumps({card_name(): tuning}, indent=1, sort_keys=True))
        if parts & {"ar", "verify", "draft", "memory", "published", "tp"}:
            params = random_params(cfg)
            jax.block_until_ready(params)
            for part, fn in (("memory", lambda: memory_part(shape, cfg, params, rows)),
                             ("ar", lambda: ar_part(shape, cfg, params, rows, batches, args.variants.split(","))),
                             ("tp", lambda: tp_part(shape, cfg, params, rows, batches, args.mesh)),
                             ("verify", lambda: verify_part(shape, cfg, params, rows, sizes=verify_sizes,
                                                                 variants=args.variants.split(","))),
                             ("draft", lambda: draft_part(shape, cfg, params, rows)),
                             ("published", lambda: published_part(shape, cfg, params, rows, Path(tempfile.gettempdir())))):
                if part in parts:
                    try:
                        with M.per_device_program():  # one device's program, also on a host with several GPUs
                            fn()
                    except Exception as e:  # noqa: BLE001 - one part's failure must not lose the others
                        traceback.print_exc()
                        rows.add(shape=shape, card=card_name(), method=part, error=repr(e)[:300])
            del params
        if "peer" in parts and args.peer:
            peer_part(shape, cfg, args.peer, [b for b in batches if b <= 16], rows, out_dir)


if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "bench_shapes.py"))
