"""Where an EAGLE draft step and an EAGLE-2 tree level spend their time, kernel by kernel.

Random weights of SmolLM2-135M's shape with an EAGLE-3 head (32k draft vocabulary): timing does not
depend on the weights' values, so no checkpoint is needed. For each program (chain draft loop at K = 1
and K = 6, tree build at depth 1 and depth 6) it runs `n` iterations in one jitted fori_loop under
`jax.profiler.trace`, reads the Perfetto trace and sums the GPU kernels by name. The per-step
(per-level) cost of a kernel is its difference between the long and the short program, divided by the
extra steps (levels) — the same differential method as jspec.bench.round_cost.

    python scripts/profile_draft.py --out OUT [--batch 1] [--n 20] [--top 25] [--xla-option K=V]
        [--head-attention default|xla|pallas ...] [--draft-loop policy|while ...]
        [--top-k default|lax|sort<BLOCK>|rank<BLOCK> ...] [--sections verify,draft,topk]

The head's attention runs as model.default_kernels() picks (one fused Pallas kernel on a single
GPU); `--head-attention xla pallas` times the einsum path and the kernel side by side in one process.
`--draft-loop while` times the chain under the early-exit while_loop that policies with in-round
stops get (`policy`: the static policy's own loop of known length). `--top-k` picks how
jspec.kernels.top_k selects (`lax`: jax.lax.top_k; `sortB` / `rankB`: rows ranked by a stable sort
or by counting, long rows blocked by B); the `topk` section times it alone on a tree level's shapes.
Writes OUT/profile_draft.json ({"chain": {...}, "tree": {...}}: wall µs per step / level and the
kernel table, for the first --head-attention; all of them under "head_attention") and prints the
top kernels of each.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jspec.errors import UsageError  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jspec import model as M  # noqa: E402
from jspec.bench import round_cost as RC  # noqa: E402
from jspec.cards import card_name  # noqa: E402
from jspec.heads import eagle as H  # noqa: E402
from jspec.kernels import top_k as TK  # noqa: E402
from jspec.speculative.drafters.eagle import EagleDrafter  # noqa: E402
from jspec.speculative.engines.chain import draft_autoregressive  # noqa: E402
from jspec.speculative.engines.tree import TreeConfig, draft_tree  # noqa: E402
from jspec.speculative.policies import resolve_policy  # noqa: E402
from jspec.speculative.policies.static import StaticPolicy  # noqa: E402
from measure_card_costs import SMOLLM2  # noqa: E402


def kernel_table(trace_dir: str) -> dict[int, dict[str, list[float]]]:
    """{GPU index: {kernel name: [total µs, launches]}} from the Perfetto trace in trace_dir (each
    GPU's tracks; an empty dict off a GPU)."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as fh:
        events = json.load(fh)["traceEvents"]
    gpu_of = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            found = re.search(r"GPU:(\d+)", str(e.get("args", {}).get("name", "")), re.IGNORECASE)
            if found:
                gpu_of[e["pid"]] = int(found.group(1))
    if not gpu_of and jax.default_backend() == "gpu":
        print("no GPU track among the trace's processes", flush=True)
    table: dict[int, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0]))
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_of:
            entry = table[gpu_of[e["pid"]]][e["name"]]
            entry[0] += float(e.get("dur", 0.0))
            entry[1] += 1
    return {gpu: dict(kernels) for gpu, kernels in table.items()}


def device_kernels(trace_dir: str) -> tuple[dict[str, float], int]:
    """(total µs per kernel name, number of kernel launches) on the first GPU's tracks."""
    kernels = kernel_table(trace_dir).get(0, {})
    return {name: us for name, (us, _) in kernels.items()}, sum(n for _, n in kernels.values())


XLA_OPTIONS: dict = {}  # compiler options of every timed program (--xla-option)
HLO_DIR: list[str] = []  # --dump-hlo: where each timed program's optimized HLO goes


def traced(fn, consts, carry, n: int, prepare=None) -> tuple[float, dict[str, float], float]:
    """(wall µs, kernel µs by name, kernel launches), per iteration of n in one program.
    `prepare` maps the constants inside the program before its loop (as generation does with
    model.loop_params)."""

    def program(k, c):
        k = prepare(k) if prepare else k
        return jax.lax.fori_loop(0, n, lambda i, x: fn(k, x), c)

    run = jax.jit(program, compiler_options=XLA_OPTIONS or None)
    jax.block_until_ready(run(consts, carry))
    if HLO_DIR:
        path = os.path.join(HLO_DIR[0], f"program_{len(os.listdir(HLO_DIR[0])):02d}.hlo.txt")
        with open(path, "w") as fh:
            fh.write(run.lower(consts, carry).compile().as_text())
    t0 = time.perf_counter()
    jax.block_until_ready(run(consts, carry))
    wall = 1e6 * (time.perf_counter() - t0) / n
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(run(consts, carry))
        kernels, launches = device_kernels(d)
    return wall, {k: v / n for k, v in kernels.items()}, launches / n


class WhileLoopStatic(StaticPolicy):
    """The static policy drafted under the early-exit while_loop (as if it could stop in a round)."""

    stops_in_round = True


SHIPPED_TOP_K = (TK.BLOCK, TK.RANK_COMPARES, TK.top_k)


def set_top_k(variant: str) -> None:
    """Point jspec.kernels.top_k (and the modules that imported it) at a --top-k variant."""
    import jspec.speculative.engines.tree as tree_engine

    block, rank_compares, fn = SHIPPED_TOP_K
    if variant == "lax":
        fn = lambda x, k, block=None: jax.lax.top_k(x, k)  # noqa: E731
    elif variant != "default":
        kind, width = variant[:4], variant[4:]
        if kind not in ("sort", "rank") or not width.isdigit():
            raise UsageError(f"--top-k {variant!r}: expected default, lax, sort<BLOCK> or rank<BLOCK>")
        block, rank_compares = int(width), (1 << 62 if kind == "rank" else 0)
    TK.BLOCK, TK.RANK_COMPARES = block, rank_compares
    tree_engine.top_k = fn


def per_unit(short, long, units: int) -> tuple[float, list[tuple[str, float, float]]]:
    """Differential wall µs per unit, and per-kernel (name, µs per unit, µs in the long program)."""
    (ws, ks, _), (wl, kl, _) = short, long
    rows = [(name, (kl.get(name, 0.0) - ks.get(name, 0.0)) / units, kl.get(name, 0.0)) for name in set(ks) | set(kl)]
    rows.sort(key=lambda r: -r[1])
    return (wl - ws) / units, rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--k", type=int, default=6, help="chain draft length (and tree depth)")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--xla-option", action="append", default=[],
                    help="KEY=VALUE compiler option for every timed program (repeatable), e.g. "
                         "xla_gpu_enable_dot_strength_reduction=false")
    ap.add_argument("--top-k", nargs="+", default=["default"],
                    help="how top_k selects, several timed one after another: default (jspec.kernels.top_k "
                         "as shipped), lax (jax.lax.top_k), sort<BLOCK> or rank<BLOCK> (e.g. sort128 rank64)")
    ap.add_argument("--draft-loop", nargs="+", default=["policy"], choices=("policy", "while"),
                    help="chain draft loop: policy (the static policy's loop of known length) or while "
                         "(the early-exit while_loop of policies that stop inside a round)")
    ap.add_argument("--unroll", type=int, default=None,
                    help="layer-scan unroll of the verify forwards (default: model.forward's auto)")
    ap.add_argument("--dump-hlo", action="store_true", help="write each program's optimized HLO under OUT/hlo")
    ap.add_argument("--sections", default="verify,draft",
                    help="comma-separated: verify (T=1 and a 60-node tree, with model.loop_params' per-layer "
                         "weights and with the stacked ones), draft (chain steps and tree levels), topk (top_k alone on a tree level's shapes)")
    ap.add_argument("--head-attention", nargs="+", default=["default"], choices=("default", "xla", "pallas"),
                    help="how the draft head's attention runs: default (model.default_kernels()), xla (einsums) "
                         "or pallas (the fused kernel); several are timed one after another")
    args = ap.parse_args(argv)
    if args.dump_hlo:
        HLO_DIR.append(os.path.join(args.out, "hlo"))
        os.makedirs(HLO_DIR[0], exist_ok=True)
    for item in args.xla_option:
        key, _, value = item.partition("=")
        XLA_OPTIONS[key] = {"true": True, "false": False}.get(value.lower(), value)
    if args.batch < 1 or args.n < 1 or args.k < 2:
        ap.error("--batch and --n must be >= 1 and --k >= 2")
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    tparams = M.init_params(SMOLLM2, jax.random.PRNGKey(0), dtype)
    hcfg = H.HeadConfig("eagle3", SMOLLM2, draft_vocab_size=args.draft_vocab)
    dparams = H.init_head(hcfg, jax.random.PRNGKey(1), dtype)
    drafter = EagleDrafter(hcfg)  # prefill and the initial state; the timed programs pick their own
    K, n, B = args.k, args.n, args.batch
    prompt_len, max_new = 128, 256
    cache_len = prompt_len + max_new + 128
    policy = resolve_policy("static", K)
    state = RC._start(tparams, SMOLLM2, drafter, dparams, policy, None, K, B, prompt_len, max_new, cache_len)
    print(f"{card_name()}, batch {B}, K/depth {K}, n {n}, kernels {M.default_kernels()}", flush=True)

    def chain(drafter, k_max, loop="policy"):
        pol = WhileLoopStatic(k_max=k_max) if loop == "while" else resolve_policy("static", k_max)
        limit = jnp.full(state.last.shape, k_max, jnp.int32)

        def body(k, st):
            draft, dstate, _, pstate = draft_autoregressive(drafter, k[1], k[0], SMOLLM2, st, st.pstate, pol, limit,
                                                            k_max, RC.GREEDY, st.key, False)
            return st.replace(last=draft.tokens[:, -1], dstate=dstate, pstate=pstate)

        return traced(body, (tparams, dparams), state.replace(pstate=pol.init(B, jax.random.PRNGKey(0))), n)

    def tree(drafter, depth):
        tc = TreeConfig(10, depth, 10)
        pol = resolve_policy("static", depth)
        limit = jnp.full(state.last.shape, depth, jnp.int32)
        pstate = pol.init(B, jax.random.PRNGKey(0))

        # the drafter state rides in the carry, as in the engine's round loop: the fused levels write
        # the head cache's scratch slots in place instead of into a copy of a loop constant
        def body(k, c):
            tr, _, dstate = draft_tree(drafter, k[1], k[0], SMOLLM2, c[2], c[0], tc, pol, pstate, limit)
            return tr.tokens[:, -1], c[1] + jnp.sum(tr.ancestors, (1, 2)), dstate

        return traced(body, (tparams, dparams), (state.last, jnp.zeros((B,), jnp.int32), state.dstate), n)

    def verify(T, tree_mask, stacked=False):
        """The target's verify forward of T tokens (+ LM head + argmax); T = 1 is an AR step. The
        weights are model.loop_params' (as in generation) unless `stacked`."""
        cache = RC.filled_cache(tparams, SMOLLM2, B, cache_len, prompt_len)
        mask, depth = RC.random_tree_mask(T, B) if tree_mask else (None, jnp.arange(T, dtype=jnp.int32))
        pos = cache.lengths[:, None] + depth[None]

        def body(k, c):
            o = M.forward(k[0], SMOLLM2, c[0], k[1], positions=k[2], new_mask=k[3] if tree_mask else None,
                          capture=drafter.capture_layers, unroll=args.unroll)
            nxt = jnp.argmax(M.lm_head(k[0], SMOLLM2, o.hidden), -1).astype(jnp.int32)
            return nxt, c[1] + o.cache.k[0, :, 0, 0, 0].astype(jnp.float32)

        consts = (tparams, cache, pos, mask if tree_mask else jnp.zeros((), bool))
        prepare = None if stacked else (lambda k: (M.loop_params(k[0], SMOLLM2, unroll=args.unroll), *k[1:]))
        return traced(body, consts, (jnp.zeros((B, T), jnp.int32), jnp.zeros((B,), jnp.float32)), n, prepare)

    report = {"card": card_name(), "batch": B, "k": K, "n": n, "kernels": M.default_kernels(),
              "xla_options": XLA_OPTIONS, "head_attention": {}}
    sections = set(args.sections.split(","))
    cases = [(T, m, st) for st in (False, True) for T, m in ((1, False), (60, True))] if "verify" in sections else []
    for T, tree_mask, stacked in cases:
        wall, kern, launches = verify(T, tree_mask, stacked)
        rows = sorted(kern.items(), key=lambda kv: -kv[1])
        key = f"verify_{'tree' if tree_mask else ''}{T}{'_stacked' if stacked else ''}"
        report[key] = {"wall_us": wall, "gpu_us": sum(kern.values()), "launches": launches,
                       "kernels": [{"name": k, "us": v} for k, v in rows]}
        print(f"\n{key}: {wall:.1f} µs (wall), {sum(kern.values()):.1f} µs of GPU kernels, {launches:.0f} launches",
              flush=True)
        for k, v in rows[: args.top]:
            print(f"  {v:8.2f} µs  {k[:110]}")
    if "topk" in sections:
        # a tree level's selections: each frontier node's children (10 x draft vocab), the next
        # frontier (10 of 100) and the kept nodes (59 of 510); a policy's top-2 over the target vocab
        shapes = [((B * 10, args.draft_vocab), 10), ((B, 100), 10), ((B, 510), 59), ((B, SMOLLM2.vocab_size), 2)]
        for variant in args.top_k:
            set_top_k(variant)
            rows = report.setdefault("top_k", {}).setdefault(variant, {})
            for shape, k in shapes:
                x = jax.random.normal(jax.random.PRNGKey(2), shape, jnp.float32)
                fn = lambda xs, c, k=k: c + TK.top_k(xs + c[:, :1] * 1e-9, k)[0][:, :1]  # noqa: E731
                wall, kern, launches = traced(lambda xs, c: fn(xs, c), x, jnp.zeros((shape[0], 1), jnp.float32), n)
                key = f"{shape[0]}x{shape[1]}_k{k}"
                rows[key] = {"wall_us": wall, "gpu_us": sum(kern.values()), "launches": launches}
                print(f"top_k {variant:>8} {key:>14}: {wall:6.1f} µs wall, {sum(kern.values()):6.1f} µs GPU, "
                      f"{launches:.0f} launches", flush=True)
        set_top_k("default")
    runs = [(mode, loop, tk) for mode in args.head_attention for loop in args.draft_loop for tk in args.top_k]
    for mode, loop, tk in runs if "draft" in sections else ():
        d = EagleDrafter(hcfg, kernels=None if mode == "default" else mode)
        fused = H.fused_head_attention(hcfg, 1, d.kernels), H.fused_head_attention(hcfg, (K - 1) * 10, d.kernels)
        label = mode + ("" if loop == "policy" else f"/{loop}") + ("" if tk == "default" else f"/top_k={tk}")
        section = report["head_attention"].setdefault(label, {"fused_chain": fused[0], "fused_tree": fused[1]})
        set_top_k(tk)
        programs = []
        if tk == args.top_k[0]:  # the chain does not select top-k: timed once per loop
            programs.append(("chain", chain(d, 1, loop), chain(d, K, loop)))
        if loop == args.draft_loop[0]:  # the tree has no draft loop: timed once per top-k
            programs.append(("tree", tree(d, 1), tree(d, K)))
        for name, short, long in programs:
            wall, rows = per_unit(short, long, K - 1)
            gpu = sum(r[1] for r in rows)
            launches = (long[2] - short[2]) / (K - 1)
            section[name] = {"wall_us_per_unit": wall, "gpu_us_per_unit": gpu, "launches_per_unit": launches,
                             "short_wall_us": short[0],
                             "long_wall_us": long[0], "kernels_per_unit": [
                                 {"name": r[0], "us_per_unit": r[1], "us_long": r[2]} for r in rows]}
            report.setdefault(name, section[name])  # the first run's, where earlier reports kept it
            unit = "draft step" if name == "chain" else "tree level"
            path = "fused kernel" if fused[name == "tree"] else "einsum"
            print(f"\n{name} ({label}, head attention: {path}): {wall:.1f} µs per {unit} (wall), {gpu:.1f} µs of "
                  f"GPU kernels, {launches:.1f} kernel launches per {unit}", flush=True)
            for r in rows[: args.top]:
                print(f"  {r[1]:8.2f} µs  {r[0][:110]}")
        set_top_k("default")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_draft.json"), "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "profile_draft.py"))
