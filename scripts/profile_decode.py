"""Profile jspec's jitted decode and verify forwards on a model of SmolLM2-135M's shape (random weights;
--shape NAME: another of scripts/bench_shapes.py's shapes).

Side by side in one process, for each layer implementation (model.KERNEL_IMPLS: the portable "xla"
einsum path, "pallas" = fused attention kernel + the matvec kernel for few-row products (set
JSPEC_MATMUL=xla for XLA's dots), "cudnn" attention):
  * kernels: the kernel count of a decode step, read from the compiled HLO (the layer scan's while
    body, found by its trip count, is the per-layer count), with the layer body's op list;
  * decode: the AR decode step (forward + LM head + argmax + cursor advance) timed inside one jitted
    fori_loop, at each --batches, with 192 committed cache slots;
  * compare: logits of decode (T=1), chain (T=8) and tree (T=60, random ancestor mask) forwards
    against the "xla" path on the same cache (max |diff|, relative norm, argmax agreement);
  * generate: whole jitted generations (jspec.decode.generate_ar_jit, prefill 64 + 256 new tokens)
    in tokens/s;
  * layers: a differential profile (0 / 15 / 30 layers) giving per-layer and fixed cost;
  * verify: the verify forward's cost as a function of block size T (1 .. 64, and a 60-node tree)
    per batch: forward of T tokens + LM head on all of them + argmax, cursor not moved (verify_us,
    and vs_T1 = verify(T) / verify(1), where verify(1) is an AR step);
Prints each row as it is measured; writes JSON (rewritten after every row, so a killed run keeps
what it measured) and each variant's compiled decode HLO to $OUT when set. --quick = kernels and
the batch-1 decode step only (for XLA-flag variants, which need a process each).
"""
import argparse
import functools
import json
import os
import re
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jspec import model as M
from jspec.cards import card_name
from jspec.config import ModelConfig

SMOLLM2 = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True, eos_token_ids=())

KERNEL_OPS = ("fusion", "custom-call", "copy", "scatter", "dynamic-update-slice", "dynamic-slice", "gather", "sort",
              "dot", "reduce", "convolution", "all-reduce", "copy-start", "transpose", "pad", "concatenate", "slice")
CACHE_LEN = 640  # prompt 64 + 256 new, rounded as plan_cache_len does
COMMITTED = 192  # committed slots when timing steps (mid-generation)
OUT = os.environ.get("OUT")
LAYERS = SMOLLM2.num_layers


def timed(f, *args, reps=3):
    jax.block_until_ready(f(*args))  # compile + warm up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def filled_cache(params, cfg, batch, impl, committed=COMMITTED, key=1):
    """A cache with `committed` random tokens already run through the model (same for every impl)."""
    cache = M.init_cache(cfg, batch, CACHE_LEN, params["embed"].dtype)
    toks = jax.random.randint(jax.random.PRNGKey(key), (batch, committed), 0, cfg.vocab_size)
    out = _prefill_cache(params, cfg, toks, cache)
    return out.replace(lengths=jnp.full((batch,), committed, jnp.int32))


@functools.partial(jax.jit, static_argnums=1)
def _prefill_cache(params, cfg, toks, cache):
    return M.forward(params, cfg, toks, cache, kernels="xla").cache


def tree_mask(T, batch, key=0):
    """A random tree of T nodes: node i's parent is a random earlier node; mask = ancestors-or-self."""
    rng = np.random.RandomState(key)
    parent = [-1] + [int(rng.randint(0, i)) for i in range(1, T)]
    anc = np.zeros((T, T), bool)
    for i in range(T):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parent[j]
    depth = anc.sum(1) - 1
    return jnp.asarray(np.broadcast_to(anc, (batch, T, T))), jnp.asarray(depth, jnp.int32)


def make_verify(cfg, impl, T, n, tree=None):
    """n verify forwards of T tokens (+ LM head on all, argmax) in one jitted loop; cursor fixed."""
    mask, depth = (None, None) if tree is None else tree

    @jax.jit
    def run(params, cache, toks):
        pos = cache.lengths[:, None] + (jnp.arange(T, dtype=jnp.int32)[None] if depth is None else depth[None])

        def body(i, c):
            cache, toks = c
            out = M.forward(params, cfg, toks, cache, positions=pos, new_mask=mask, kernels=impl)
            nxt = jnp.argmax(M.lm_head(params, cfg, out.hidden), -1).astype(jnp.int32)
            return out.cache, nxt

        return jax.lax.fori_loop(0, n, body, (cache, toks))

    return run


def make_decode(cfg, impl, n):
    """n AR decode steps (forward of 1 token, LM head, argmax, advance) in one jitted loop."""

    def run(params, cache, tok):
        def body(i, c):
            cache, tok = c
            out = M.forward(params, cfg, tok[:, None], cache, kernels=impl)
            nxt = jnp.argmax(M.lm_head(params, cfg, out.hidden[:, 0]), -1).astype(jnp.int32)
            return M.advance(out.cache, jnp.ones_like(nxt)), nxt

        return jax.lax.fori_loop(0, n, body, (cache, tok))

    return jax.jit(run, donate_argnums=1)


def step_ms(params, cfg, impl, batch, n=200):
    f = make_decode(cfg, impl, n)
    fresh = lambda: filled_cache(params, cfg, batch, impl)
    tok = jnp.zeros((batch,), jnp.int32)
    jax.block_until_ready(f(params, fresh(), tok))
    ts = []
    for _ in range(3):
        c = fresh(); jax.block_until_ready(c)
        t0 = time.perf_counter()
        jax.block_until_ready(f(params, c, tok))
        ts.append(time.perf_counter() - t0)
    return 1000 * float(np.median(ts)) / n


def hlo_kernels(text):
    """Kernel-launching instructions per computation of a compiled module, and each while body."""
    comps, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) ", line)
        if m and line.rstrip().endswith("{"):
            cur = m.group(2); comps[cur] = []
        elif cur and "=" in line and not line.lstrip().startswith("ROOT %tuple") :
            # the shape may be a tuple with spaces: "(bf16[..]{..}, bf16[..]{..}) custom-call("
            op = re.search(r"=\s*(?:\([^)]*\)|\S+)\s+([a-z\-]+)\(", line)
            if op and op.group(1) in KERNEL_OPS:
                name = op.group(1)
                tgt = re.search(r'custom_call_target="([^"]+)"', line)
                kind = re.search(r"kind=(k\w+)", line)
                calls = re.search(r"calls=%?([\w.\-]+)", line)
                label = name + (":" + tgt.group(1) if tgt else "") + (":" + kind.group(1) if kind else "")
                if calls:
                    label += ":" + calls.group(1)
                comps[cur].append(label)
    bodies = re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)(.*)", text)
    body_counts = {b: len(comps.get(b, [])) for b, _ in bodies}
    trips = {b: int(m.group(1)) for b, rest in bodies if (m := re.search(r'known_trip_count":\{"n":"(\d+)"', rest))}
    entry = [c for c in comps if c.startswith("main")]
    # the layer scan's body is the while with num_layers trips (else the one with the most kernels)
    by_trip = [b for b, n in trips.items() if n == LAYERS]
    layer_body = by_trip[0] if by_trip else (max(body_counts, key=body_counts.get) if body_counts else None)
    return dict(entry_kernels=len(comps[entry[0]]) if entry else None, while_bodies=body_counts, while_trips=trips,
                layer_body_kernels=body_counts.get(layer_body), layer_body_ops=comps.get(layer_body, []))


def kernel_report(params, cfg, impl, batch=1):
    f = make_decode(cfg, impl, 8)
    cache = filled_cache(params, cfg, batch, impl)
    text = f.lower(params, cache, jnp.zeros((batch,), jnp.int32)).compile().as_text()
    if OUT:
        open(os.path.join(OUT, f"hlo_decode_{impl}.txt"), "w").write(text)
    return hlo_kernels(text)


def compare(params, cfg, impl, batch):
    """Logits of impl vs xla on the same cache: decode, chain and tree blocks."""
    cache = filled_cache(params, cfg, batch, impl, key=7)
    res = {}
    for name, T, tree in (("decode", 1, None), ("chain8", 8, None), ("tree60", 60, tree_mask(60, batch, 3))):
        toks = jax.random.randint(jax.random.PRNGKey(T), (batch, T), 0, cfg.vocab_size)
        mask, depth = (None, None) if tree is None else tree
        pos = cache.lengths[:, None] + (jnp.arange(T, dtype=jnp.int32)[None] if depth is None else depth[None])

        def f(p, c, t, impl_):
            out = M.forward(p, cfg, t, c, positions=pos, new_mask=mask, kernels=impl_)
            return M.lm_head(p, cfg, out.hidden), out.cache.k, out.cache.v

        ref = jax.jit(lambda p, c, t: f(p, c, t, "xla"))(params, cache, toks)
        got = jax.jit(lambda p, c, t: f(p, c, t, impl))(params, cache, toks)
        a, b = np.asarray(ref[0], np.float32), np.asarray(got[0], np.float32)
        res[name] = dict(max_abs=float(np.abs(a - b).max()), rel=float(np.linalg.norm(a - b) / np.linalg.norm(a)),
                         argmax_agree=float((a.argmax(-1) == b.argmax(-1)).mean()),
                         k_cache_max_abs=float(jnp.max(jnp.abs(ref[1].astype(jnp.float32) - got[1].astype(jnp.float32)))),
                         v_cache_max_abs=float(jnp.max(jnp.abs(ref[2].astype(jnp.float32) - got[2].astype(jnp.float32)))))
    return res


def verify_sweep(params, cfg, impl, batch, Ts=(1, 2, 4, 8, 16, 32, 64), n=50):
    cache = filled_cache(params, cfg, batch, impl)
    rows = []
    for T in (*Ts, "tree60"):
        tree = tree_mask(60, batch) if T == "tree60" else None
        t = 60 if tree is not None else T
        f = make_verify(cfg, impl, t, n, tree)
        toks = jnp.zeros((batch, t), jnp.int32)
        us = 1e6 * timed(f, params, cache, toks) / n
        rows.append(dict(kind="verify", impl=impl, batch=batch, T=T, verify_us=round(us, 1)))
        print(rows[-1], flush=True)
    base = rows[0]["verify_us"]
    for r in rows:
        r["vs_T1"] = round(r["verify_us"] / base, 3)
    return rows


def generation(params, cfg, impl, batch, prompt=64, new=256):
    from jspec.decode import generate_ar_jit, plan_cache_len
    from jspec.sampling import GREEDY

    os.environ["JSPEC_KERNELS"] = impl  # read at trace time: clear jit caches between impls
    jax.clear_caches()
    toks = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (batch, prompt)), jnp.int32)
    lens = jnp.full((batch,), prompt, jnp.int32)
    kw = dict(max_new=new, cache_len=plan_cache_len(prompt, new), sampling=GREEDY)
    t = timed(lambda: generate_ar_jit(params, cfg, toks, lens, jax.random.PRNGKey(0), **kw))
    del os.environ["JSPEC_KERNELS"]
    return dict(kind="generate", impl=impl, batch=batch, wall_s=round(t, 4), tokens_per_s=round(batch * new / t, 1),
                ms_per_token_step=round(1000 * t / new, 4))


SAVE = None  # set in main: writes the rows so far (a killed run keeps what it measured)


def attempt(rows, fn, *a, **kw):
    try:
        r = fn(*a, **kw)
    except Exception as e:  # one failing variant must not cost the others' numbers
        traceback.print_exc()
        r = dict(kind="error", fn=fn.__name__, args=[str(x) for x in a[2:]], error=f"{type(e).__name__}: {e}"[:2000])
    if isinstance(r, list):
        rows.extend(r)
    else:
        rows.append(r)
        print(r, flush=True)
    if SAVE:
        SAVE(rows)
    return r


def main():
    global LAYERS
    ap = argparse.ArgumentParser()
    ap.add_argument("--impls", default="xla,pallas,cudnn")
    ap.add_argument("--sections", default="kernels,decode,compare,generate,layers,verify")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--verify-impls", default="xla,pallas")
    ap.add_argument("--verify-n", type=int, default=50, help="forwards per timed verify loop")
    ap.add_argument("--quick", action="store_true", help="= --sections kernels,decode --batches 1")
    ap.add_argument("--tag", default="", help="suffix of the JSON file (e.g. the XLA flags)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy model (CPU smoke test of this script)")
    ap.add_argument("--shape", default="", help="profile one of bench_shapes.py's shapes (e.g. llama-3.2-1b) "
                                                 "instead of SmolLM2-135M's")
    a = ap.parse_args()
    if a.quick:
        a.sections, a.batches = "kernels,decode", "1"
    impls, sections = a.impls.split(","), a.sections.split(",")
    batches = [int(b) for b in a.batches.split(",")]
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    card = card_name()
    cfg = SMOLLM2
    if a.shape:
        from bench_shapes import SHAPES  # this script's folder is on sys.path
        if a.shape not in SHAPES:
            ap.error(f"--shape {a.shape!r}: expected one of {', '.join(SHAPES)}")
        cfg = SHAPES[a.shape]
        LAYERS = cfg.num_layers
    if a.tiny:
        LAYERS = 2
        cfg = cfg.replace(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=3,
                          num_kv_heads=1, head_dim=64)
    params = M.init_params(cfg, jax.random.PRNGKey(0), dtype)
    rows = []
    global SAVE
    if OUT:
        name = "profile_decode" + (f"_{a.tag}" if a.tag else "") + ".json"
        SAVE = lambda rows: json.dump(dict(card=card, jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""),
                                           rows=rows), open(os.path.join(OUT, name), "w"), indent=1)
    for impl in impls:
        if "kernels" in sections:
            attempt(rows, lambda p, c, i: dict(kind="kernels", impl=i, **kernel_report(p, c, i)), params, cfg, impl)
        if "decode" in sections:
            for batch in batches:
                attempt(rows, lambda p, c, i, b: dict(kind="decode_step", impl=i, batch=b, committed=COMMITTED,
                                                      ms_per_step=round(step_ms(p, c, i, b), 4)), params, cfg, impl, batch)
    if "compare" in sections:
        for impl in [i for i in impls if i != "xla"]:
            for batch in batches:
                attempt(rows, lambda p, c, i, b: dict(kind="compare", impl=i, batch=b, **compare(p, c, i, b)),
                        params, cfg, impl, batch)
    if "generate" in sections:
        for impl in impls:
            for batch in batches:
                attempt(rows, generation, params, cfg, impl, batch)
    if "layers" in sections:
        for impl in impls[:2]:
            for L in (0, 15, 30):  # differential profile: fixed cost + L x per-layer cost
                c = cfg.replace(num_layers=L)
                p = {**params, "layers": jax.tree.map(lambda x: x[:L], params["layers"])}
                attempt(rows, lambda p, c, i, L=L: dict(kind="layers", impl=i, layers=L, batch=1,
                                                        ms_per_step=round(step_ms(p, c, i, 1), 4)), p, c, impl)
    if "verify" in sections:
        for impl in a.verify_impls.split(","):
            for batch in batches:
                attempt(rows, verify_sweep, params, cfg, impl, batch, n=a.verify_n)
    print(f"card: {card}, jax {jax.__version__}, dtype {jnp.dtype(dtype).name}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
    for r in rows:
        print({k: v for k, v in r.items() if k != "layer_body_ops"})
    if SAVE:
        SAVE(rows)


if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "profile_decode.py"))
