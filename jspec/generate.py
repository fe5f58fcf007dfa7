"""Host-side generation API: `generate` (batched) and `generate_stream` (one prompt, chunked).

`generate` is the one entry point: plain autoregressive decoding (jspec.decode) when `speculative`
is None, speculative decoding with its SpeculativeConfig otherwise, with chains (jspec.speculative.engines.chain) or EAGLE-2
trees (jspec.speculative.engines.tree). All paths share the prompt handling, the output buffer and
the stopping rules, so their greedy outputs can be compared token for token.

`mesh=` runs the same call on several devices (a `Mesh` with axes "data" and/or "model", or a spec
string such as "data=2" or "data=2,model=2"):
  - data: rows are split over the data axis with `shard_map`; each device runs its own rows'
    while_loop to its own end, so no device waits for another's acceptance between rounds;
  - model: tensor parallelism. The target's weights are laid out per head and split over the
    model axis (jspec.sharding's tensor-parallel layout), and the whole generation runs under
    `shard_map`: each device runs the one-device program (GPU kernels included) on its heads, its
    kv heads and its slice of the MLP, with one psum after each attention block and each MLP. The
    drafter and the policy are replicated; EAGLE-3 features come from the split target. The
    placed layout is kept for the next call on the same weights and mesh (one placement: a copy
    of the weights spread over the mesh, freed with the source weights or by another placement).
    Both ("data=2,model=2"): rows over data, and each data shard's model group runs its rows'
    while_loop tensor-parallel (collectives only within the group).
Greedy outputs equal one device's; sampled outputs are lossless but follow other random streams.

SpeculativeConfig(engine="pearl" / "ppsd" / "specbranch") runs the parallel engines, which draft while the target verifies
(jspec.speculative.engines.pearl / .ppsd): one device runs both roles one after the other; a mesh
"role=2" (or "data=N,role=2", or a pearl_mesh) puts the drafter and the target on a pair of devices.

This module sits above every engine; engines import jspec.decode, never this module.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from . import model as M
from .compile_cache import enable_default_compile_cache
from .config import ModelConfig
from .errors import UsageError
from .refill import default_refill
from .decode import (GenerationResult, bucket, check_token_lists, decode_loop_jit, generate_ar_jit, pack_prompts, shared_cache_len,
                     start_decode_jit, stream_row0)
from .sampling import GREEDY, Sampling
from .sharding import (axis_size, parse_mesh, placed_tensor_parallel, replicate, shard_params, tensor_parallel_config,
                       tensor_parallel_map, tensor_parallel_specs)
from .speculative.drafters.eagle import EagleDrafter
from .speculative.drafters.hybrid import HybridDrafter
from .speculative.drafters.early_exit import EarlyExitDrafter
from .speculative.drafters.model import ModelDrafter
from .speculative.engines.chain import check_compatible, speculative_generate, speculative_generate_jit
from .speculative.engines.pearl import DATA_AXIS as ROLE_MESH_DATA, measure_gamma, parse_role_mesh, pearl_generate
from .speculative.engines.ppsd import ppsd_generate
from .speculative.engines.specbranch import SpecBranchConfig, specbranch_generate
from .speculative.config import SpeculativeConfig
from .speculative.engines.tree import autotuned_tree, tree_config, tree_for, tree_generate, tree_generate_jit
from .presets import models_dir
from .speculative.factory import auto_plan, build_drafter, policy_for_drafter
from .speculative.policies import is_auto, resolve_policy
from .speculative.policies.auto import AutoPlan, auto_budget, load_costs, mean_context, tail_rows as auto_tail_rows
from .speculative.state import result_from_device
from .speculative.verify.consultant import resolve_verify


_LEGACY_KEYWORDS = ("drafter", "drafter_params", "policy", "policy_params", "k_max", "verify", "tree", "engine", "gamma")


def generate(
    params: dict,
    cfg: ModelConfig,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = 128,
    sampling: Sampling | None = None,
    speculative: SpeculativeConfig | None = None,
    policy_state=None,
    seed: int = 0,
    cache_len: int | None = None,
    unroll: int | bool | None = None,
    mesh: Mesh | str | None = None,
    batch_size: int | None = None,
    refill: int | None = None,
    tail_rows: int | None = None,
    invariant: bool | int = False,
    **legacy,
) -> GenerationResult:
    """Generate up to max_new_tokens per prompt (token-id lists), batched.

    speculative=None: autoregressive decoding. Otherwise a SpeculativeConfig (drafter, policy,
    k_max or tree, verify rule, or a parallel engine; checked when built): speculative decoding
    with chains (jspec.speculative.engines.chain), EAGLE-2 dynamic trees (`tree`: a TreeConfig,
    True for EAGLE-2's defaults, or "auto" for EAGLE-2's top_k and depth with num_nodes timed on
    this device, like EAGLE's total_token=-1), or the parallel engines (`engine`: "pearl" — a
    draft model drafts γ tokens while the target verifies, `gamma` None measures
    round(t_target / t_draft) once per process; "ppsd" — the two-stage early-exit pipeline;
    "specbranch" / a SpecBranchConfig — PEARL plus branches and hybrid lengths). The parallel
    engines' `mesh` is None (one device) or "role=2" / "data=N,role=2" (device pairs); their
    results are ParallelResults (rollback_rate, devices, gamma).
    `policy_state`: the `policy_state` of an earlier result with the same policy and batch size, to
    carry the policy's learned state (TapOut's bandit, AdaEDL's lambda, ...) across calls, as a
    serving loop would; None starts fresh. Speculative results carry their final `policy_state`.
    `mesh` spreads the call over devices (see the module docstring); a batch that does not divide
    the data axis is padded with repeated rows whose results are dropped.
    `batch_size`: rows in flight (None: every prompt in one batch). With fewer rows than prompts,
    a finished row takes the next prompt inside the same jitted loop (continuous batching,
    jspec.refill), `refill` rows at a time (default a quarter of the rows); results stay in prompt
    order. AR / chain / tree generation, on any mesh: each data shard keeps batch_size / N rows in
    flight over its share of the prompts (not with a parallel engine).
    `tail_rows`: once no prompt waits and at most this many rows still run, those rows move to a
    batch of `tail_rows` rows (re-prefilled with their prompt and tokens so far; `auto` plans it
    afresh for its size) and finish there, instead of riding in a batch sized for all rows. None:
    `auto`'s choice with continuous batching (policies.auto.tail_rows), none otherwise; 0: never.
    One device only. Outputs are the same law (greedy: the same tokens up to rounding), and each
    row's statistics count its tail's calls, the tail's prefill among them.
    `invariant`: every decode step and chain verify block runs as a block of the same shape
    (INVARIANT_BLOCK tokens, or this many; ModelConfig.fixed_block), so AR and speculative chains
    round alike and greedy outputs are equal bit for bit in bf16 too, at the cost of padded
    forwards on the portable kernels. AR and chains at one device without a tail (`check_fixed_block`);
    compare runs at the same batch size and dtype. Also taken from `cfg.fixed_block`.
    The SpeculativeConfig fields as keywords (drafter=, policy=, k_max=, ...) still work, with a
    DeprecationWarning; they build the same config.
    """
    speculative = _speculative_from_keywords(speculative, legacy)
    if invariant:
        cfg = cfg.replace(fixed_block=INVARIANT_BLOCK if invariant is True else int(invariant))
    if cfg.fixed_block:
        check_fixed_block(cfg.fixed_block, speculative, mesh, tail_rows)
        tail_rows = 0
    enable_default_compile_cache()
    # Every program below runs whole on each device (tensor parallelism too: it runs under a
    # shard_map), so the GPU kernels may run on a host with several GPUs (model.default_kernels).
    check_token_lists(prompts)  # before anything below measures the prompts
    batch_size, refill, tail_rows = (_count(v) for v in (batch_size, refill, tail_rows))
    rows = queue_rows(len(prompts), batch_size, refill, mesh, speculative)
    check_tail_rows(tail_rows, prompts, batch_size, mesh, speculative)
    with M.per_device_program():
        return _generate(params, cfg, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                         spec=speculative, policy_state=policy_state, seed=seed, cache_len=cache_len,
                         unroll=unroll, mesh=mesh, rows=rows, tail_rows=tail_rows)


def tail_fits(cfg: ModelConfig, prompts, max_new_tokens: int, extra: int) -> bool:
    """Whether any tail fits the model's positions: a tail row's prefix (prompt and tokens so far)
    plus the tail's new-token width (another row's budget, at most max_new_tokens) and the
    speculation's `extra` cache slots."""
    return max(len(p) for p in prompts) + 2 * max_new_tokens + extra <= cfg.max_position_embeddings


INVARIANT_BLOCK = 16  # generate(invariant=True): the block every decode and verify forward pads to (K <= 15)


def check_fixed_block(block: int, spec: SpeculativeConfig | None, mesh, tail_rows) -> None:
    """What fixed-block (invariant) generation covers, checked before anything is built: AR and
    speculative chains of at most fixed_block - 1 drafts, on one device, without a tail batch. A
    tree's drafts sit at node slots, so their scores sum over the cache in another order than AR's;
    a tail moves rows to another batch size. Raises UsageError, one line."""
    if block < 1:
        raise UsageError(f"invariant block {block}: expected at least 1 token")
    if spec is not None:
        if spec.engine is not None or spec.tree not in (None, False):
            what = f"engine={spec.engine!r}" if spec.engine is not None else "trees"
            raise UsageError(f"invariant generation covers AR and speculative chains, not {what}: "
                             "drop the tree or the engine, or invariant")
        if spec.k_max + 1 > block:
            raise UsageError(f"invariant block of {block} tokens holds at most k_max {block - 1} drafts, "
                             f"got k_max {spec.k_max}: lower k_max (or call generate(invariant={spec.k_max + 1}))")
    if mesh is not None:
        raise UsageError("invariant generation runs on one device: drop mesh")
    if tail_rows:
        raise UsageError(f"tail_rows {tail_rows}: a tail moves rows to another batch size, whose products round "
                         "otherwise; invariant generation runs none (pass tail_rows=0 or None)")


def drafted_slots(drafter, tree, k_max: int) -> int:
    """Cache slots one round of this built drafter drafts into past the committed tokens (0 for AR;
    the command line's `speculative_slots` reads the same from a config before anything is built)."""
    if drafter is None:
        return 0
    return tree.cache_slots if tree is not None else k_max + 1


def default_tail_runs(cfg: ModelConfig, prompts, batch_size, mesh, max_new_tokens: int, drafter=None, tree=None,
                      k_max: int = 8) -> bool:
    """Whether generate's `auto` adds its planned tail by itself: one device, a queue with more
    prompts than rows in flight, and room in the model's positions for the prompts, the tail and
    what the drafter drafts a round (`tail_fits`; `tree` as SpeculativeConfig takes it)."""
    tree = tree_config(tree)
    slots = drafted_slots(drafter, tree_for(drafter, tree) if drafter is not None and tree else None, k_max)
    return (mesh is None and batch_size is not None and batch_size < len(prompts)
            and tail_fits(cfg, prompts, max_new_tokens, slots))


def _count(value):
    """A NumPy integer as a Python int (a row count from an array); anything else as given, for the
    checks below to name."""
    return int(value) if isinstance(value, np.integer) else value


def check_tail_rows(tail_rows, prompts, batch_size, mesh, spec) -> None:
    """One-line errors for a `tail_rows` that cannot run, before anything loads or compiles (the
    positions it needs are checked where the speculation's cache slots are known, in _generate)."""
    if tail_rows is None:
        return
    if isinstance(tail_rows, bool) or not isinstance(tail_rows, int) or tail_rows < 0:
        raise UsageError(f"tail_rows must be a non-negative integer, got {tail_rows!r}")
    if tail_rows == 0:
        return
    rows = min(batch_size or len(prompts), len(prompts))
    if tail_rows >= rows:
        raise UsageError(f"tail_rows {tail_rows} must be fewer than the {rows} rows in flight")
    if mesh is not None:
        raise UsageError("tail_rows runs on one device: drop mesh=, or pass tail_rows=0")
    if spec is not None and spec.engine is not None:
        raise UsageError(f"tail_rows applies to AR, chain or tree generation, not engine={spec.engine!r}")


def queue_rows(n_prompts: int, batch_size, refill, mesh, spec) -> tuple[int, int] | None:
    """(rows in flight, rows per refill) for continuous batching, or None for one batch of every prompt."""
    for name, value in (("batch_size", batch_size), ("refill", refill)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UsageError(f"{name} must be a positive integer, got {value!r}")
    if batch_size is None:
        if refill is not None:
            raise UsageError("refill applies to continuous batching: give batch_size too")
        return None
    if refill is not None and refill > batch_size:
        raise UsageError(f"refill {refill} is more than the batch_size {batch_size} rows in flight")
    if batch_size >= n_prompts:
        return None
    if spec is not None and spec.engine is not None:
        raise UsageError(f"batch_size {batch_size} < {n_prompts} prompts (continuous batching) runs AR, chain or tree "
                         f"generation, not engine={spec.engine!r}: drop the engine, or pass at most batch_size prompts")
    return batch_size, refill or default_refill(batch_size)


def _speculative_from_keywords(speculative: SpeculativeConfig | None, legacy: dict) -> SpeculativeConfig | None:
    """The SpeculativeConfig of the keywords generate() took before it had one (deprecated)."""
    unknown = set(legacy) - set(_LEGACY_KEYWORDS)
    if unknown:
        raise TypeError(f"generate() got unexpected keyword arguments {sorted(unknown)}")
    given = {k: v for k, v in legacy.items() if v is not None and not (k == "verify" and v == "lossless")}
    if not given:
        return speculative
    if speculative is not None:
        raise ValueError(f"pass the speculative settings in speculative=SpeculativeConfig(...), not also as "
                         f"{', '.join(sorted(given))}")
    warnings.warn("generate(drafter=..., policy=..., ...) is deprecated: pass speculative=SpeculativeConfig(...)",
                  DeprecationWarning, stacklevel=3)
    if "drafter" not in given:
        raise ValueError(f"{', '.join(sorted(given))} {'applies' if len(given) == 1 else 'apply'} only to "
                         "speculative decoding: give a drafter")
    return SpeculativeConfig(**given)


def _generate(params, cfg, prompts, *, max_new_tokens, sampling, spec, policy_state, seed, cache_len, unroll,
              mesh, rows=None, tail_rows=None, budgets=None, key=None, min_prompt_width=0) -> GenerationResult:
    sampling = sampling or GREEDY
    if spec is None:
        drafter = drafter_params = policy = policy_params = tree = None
        k_max, verify = 8, "lossless"
    elif spec.engine is not None:
        if policy_state is not None:
            raise ValueError(f"engine={spec.engine!r} has its own schedule: policy_state does not apply")
        return _generate_parallel(spec.engine, params, cfg, prompts, drafter=spec.drafter,
                                  drafter_params=spec.drafter_params, gamma=spec.gamma, max_new=max_new_tokens,
                                  sampling=sampling, seed=seed, cache_len=cache_len, mesh=mesh,
                                  hrad_params=spec.policy_params)
    else:
        drafter, drafter_params, policy, policy_params = spec.drafter, spec.drafter_params, spec.policy, spec.policy_params
        k_max, verify, tree = spec.k_max, spec.verify_rule, spec.tree
    mesh = parse_mesh(mesh)
    autotune = tree == "auto"
    tree = tree_config(tree)  # autotune: EAGLE's largest candidate (59 nodes) sizes the cache
    drafter_spec = drafter if isinstance(drafter, str) else None
    if isinstance(drafter, str):  # read as `jspec generate` reads it: what cfg's preset ships, if any
        policy, policy_params = policy_for_drafter(policy, policy_params, drafter, cfg.preset,
                                                   tree.depth if tree is not None else k_max)
        drafter, drafter_params = build_drafter(drafter, cfg, params, k_max=k_max, draft_vocab=spec.draft_vocab)
    if tree is not None:
        tree = tree_for(drafter, tree)  # a hybrid drafter's n-gram branch
    tail = tail_rows or 0
    # the most cache slots any plan of this config drafts into: the tail's own plan may be larger
    most_slots = drafted_slots(drafter, tree, k_max)
    if tail and not tail_fits(cfg, prompts, max_new_tokens, most_slots):
        raise UsageError(f"tail_rows {tail}: the longest prompt ({max(len(p) for p in prompts)} tokens) plus twice "
                         f"max_new_tokens {max_new_tokens} plus {most_slots} speculative slots exceeds the model's "
                         f"{cfg.max_position_embeddings} positions: pass tail_rows=0")
    if drafter is not None and is_auto(policy):  # batch-aware budget
        costs = load_costs(cfg.preset, models_dir=str(models_dir()))
        context = mean_context([len(p) for p in prompts], max_new_tokens)
        if tail_rows is None and rows and default_tail_runs(cfg, prompts, rows[0], mesh, max_new_tokens, drafter, tree, k_max):
            tail = auto_tail_rows(drafter, costs, rows=rows[0], k_cap=k_max, tree=tree, context=context,
                                  prompts=prompts, sampling=sampling)
        batch = rows[0] if rows else len(prompts)
        if not isinstance(policy, AutoPlan):
            policy = auto_plan(drafter, drafter_spec, cfg.preset, costs, batch=batch, k_cap=k_max, tree=tree,
                               context=context, prompts=prompts, sampling=sampling)
        drafter, policy, k_max, tree = auto_budget(policy, drafter, k_max, tree)
        if getattr(drafter, "block", False) and drafter.k_max != k_max:  # a block drafter drafts the planned k
            drafter = dataclasses.replace(drafter, k_max=k_max)
        autotune = False
    extra = max(drafted_slots(drafter, tree, k_max), cfg.fixed_block)  # AR and chains: one cache length
    if cache_len is None and rows is None and mesh is None and _attention_reads_committed_slots(cfg, extra, drafter):
        cache_len = shared_cache_len(bucket(max(max(len(p) for p in prompts), min_prompt_width)), max_new_tokens, extra)
    tokens, lens, cache_len = pack_prompts(cfg, prompts, max_new_tokens, extra, cache_len, min_prompt_width)
    if autotune and drafter is not None:
        tree = tree_for(drafter, autotuned_tree(params, cfg, rows[0] if rows else len(prompts), cache_len, tree.top_k, tree.depth))
    key = jax.random.PRNGKey(seed) if key is None else key
    # the tail samples from a stream of its own: the queue folds each refill's count (1, 2, ...) into
    # `key`, so fold_in(key, 1) would give the tail's first tokens the first refill's noise
    key, tail_key = jax.random.split(key) if tail else (key, None)
    queue = dict(_queue_per_shard(rows, 1), stop_at_running=tail, budgets=budgets)
    if axis_size(mesh, "model") > 1:
        return _generate_tensor_parallel(
            mesh, params, cfg, tokens, lens, key, drafter=drafter, drafter_params=drafter_params, policy=policy,
            policy_params=policy_params, k_max=k_max, verify=verify, tree=tree, max_new=max_new_tokens,
            cache_len=cache_len, sampling=sampling, unroll=unroll, policy_state=policy_state, queue=rows,
        )
    if mesh is not None:
        params = shard_params(params, mesh)  # data axis: replicated
        drafter_params = None if drafter_params is None else replicate(drafter_params, mesh)
        policy_params = None if policy_params is None else replicate(policy_params, mesh)
    if axis_size(mesh, "data") > 1:
        if policy_state is not None:
            raise ValueError("policy_state is not carried across data-parallel shards; run without a data mesh")
        return _generate_data_parallel(
            mesh, params, cfg, tokens, lens, key, drafter=drafter, drafter_params=drafter_params, policy=policy,
            policy_params=policy_params, k_max=k_max, verify=verify, tree=tree, max_new=max_new_tokens,
            cache_len=cache_len, sampling=sampling, unroll=unroll, rows=rows,
        )
    if drafter is None:
        budgets = queue.pop("budgets")
        budgets = None if budgets is None else jnp.asarray(budgets, jnp.int32)
        static = dict(max_new=max_new_tokens, sampling=sampling, unroll=unroll)
        if rows is None:  # one batch: a prefill per prompt width, then one loop program per cache length
            state = start_decode_jit(params, cfg, jnp.asarray(tokens), jnp.asarray(lens), key, budgets,
                                     cache_len=cache_len, **static)
            state = decode_loop_jit(params, cfg, state, budgets, stop_at_running=tail, **static)
            out, n_out, steps = jax.device_get((state.out, state.n_out, state.steps))
        else:
            out, n_out, steps = jax.device_get(generate_ar_jit(
                params, cfg, jnp.asarray(tokens), jnp.asarray(lens), key, budgets, cache_len=cache_len, **static,
                **queue))
        zeros = np.zeros_like(n_out)
        res = GenerationResult(out, n_out, steps, zeros, zeros, steps)
    elif tree is not None:
        res = tree_generate(
            params, cfg, tokens, lens, key, drafter=drafter, drafter_params=drafter_params, policy=policy,
            policy_params=policy_params, tree=tree, max_new=max_new_tokens, cache_len=cache_len,
            sampling=sampling, unroll=unroll, policy_state=policy_state, **queue,
        )
    else:
        res = speculative_generate(
            params, cfg, tokens, lens, key,
            drafter=drafter, drafter_params=drafter_params, policy=policy, policy_params=policy_params,
            k_max=k_max, max_new=max_new_tokens, cache_len=cache_len, sampling=sampling, verify=verify, unroll=unroll,
            policy_state=policy_state, **queue,
        )
    if not tail:
        return res
    return _finish_in_tail(params, cfg, prompts, res, tail=tail, max_new_tokens=max_new_tokens, sampling=sampling,
                           spec=spec, key=tail_key, unroll=unroll)


def _attention_reads_committed_slots(cfg: ModelConfig, block: int = 1, drafter=None) -> bool:
    """Whether this call's attention runs the GPU kernel, which reads each row's committed cache
    slots only (there a cache rounded up for a shared loop costs nothing): the target's decode and
    its verify blocks of `block` tokens (a block over the kernel's MAX_BLOCK, e.g. a 59-node hybrid
    tree, takes the einsum over the whole cache), and an independent draft model's steps."""
    if M.default_kernels() != "pallas":
        return False
    draft_cfg = getattr(drafter, "cfg", None)  # a draft model attends over its own cache of the same length
    return M.fused_attention_supported(cfg, max(1, block), None) and (
        draft_cfg is None or M.fused_attention_supported(draft_cfg, 1, None))


def _unfinished_rows(cfg: ModelConfig, res: GenerationResult, max_new_tokens: int) -> list[int]:
    """Rows a queue stopped for its tail left running: under their budget, with no EOS yet."""
    eos = set(cfg.eos_token_ids or ())
    return [i for i, n in enumerate(res.lengths)
            if n < max_new_tokens and not (n and int(res.tokens[i, n - 1]) in eos)]


def _call_traces(res: GenerationResult, max_new: int) -> tuple[np.ndarray, np.ndarray]:
    """(draft lengths, tokens added) per target call; plain decoding's: 0 drafted, 1 added."""
    if res.draft_lengths is not None:
        return res.draft_lengths, res.step_tokens
    calls = np.arange(max_new + 1)[None] < np.asarray(res.target_calls)[:, None]
    return np.zeros(calls.shape, np.int32), calls.astype(np.int32)


def _finish_in_tail(params, cfg, prompts, res: GenerationResult, *, tail, max_new_tokens, sampling, spec, key,
                    unroll) -> GenerationResult:
    """Finish the rows `res` left running in one batch of `tail` rows, each row re-prefilled with
    its prompt and tokens so far and stopped at its own remaining budget; their tokens and
    statistics appended to `res`'s. The tail's shapes do not depend on where the rows stopped
    (prompt width: the longest prefix any row could have; new tokens: max_new_tokens), so a
    rollout loop compiles one tail program, not one per call. A wide cache costs no attention
    time on a GPU: the kernels read each row's committed slots only."""
    left = _unfinished_rows(cfg, res, max_new_tokens)
    if not left:
        return res
    assert len(left) <= tail, (len(left), tail)
    prefixes = [list(prompts[i]) + res.row(i) for i in left]
    budgets = [max_new_tokens - int(res.lengths[i]) for i in left]
    pad = tail - len(left)  # one batch size, whatever the count left: padding rows have no budget
    if spec is not None and is_auto(spec.policy):
        spec = dataclasses.replace(spec, policy="auto")  # planned afresh for the tail's rows
    sub = _generate(params, cfg, prefixes + [prefixes[0]] * pad, max_new_tokens=max_new_tokens, sampling=sampling,
                    spec=spec, policy_state=None, seed=0, cache_len=None, unroll=unroll, mesh=None, rows=None,
                    tail_rows=0, budgets=np.asarray(budgets + [0] * pad, np.int32), key=key,
                    min_prompt_width=max(len(p) for p in prompts) + max_new_tokens - 1)
    tokens, lengths = res.tokens.copy(), res.lengths.copy()
    calls, drafted, accepted = res.target_calls.copy(), res.drafted.copy(), res.accepted.copy()
    traced = res.draft_lengths is not None or sub.draft_lengths is not None
    if traced:
        (draft_lengths, step_tokens), (sub_d, sub_t) = _call_traces(res, max_new_tokens), _call_traces(sub, max_new_tokens)
        draft_lengths, step_tokens = draft_lengths.copy(), step_tokens.copy()
    for j, i in enumerate(left):
        n, m, c, c2 = int(lengths[i]), int(sub.lengths[j]), int(calls[i]), int(sub.target_calls[j])
        tokens[i, n:n + m] = sub.tokens[j, :m]
        if traced:
            draft_lengths[i, c:c + c2], step_tokens[i, c:c + c2] = sub_d[j, :c2], sub_t[j, :c2]
        lengths[i], calls[i] = n + m, c + c2
        drafted[i] += sub.drafted[j]
        accepted[i] += sub.accepted[j]
    return dataclasses.replace(res, tokens=tokens, lengths=lengths, target_calls=calls, drafted=drafted,
                               accepted=accepted, rounds=calls.copy(),
                               draft_lengths=draft_lengths if traced else None,
                               step_tokens=step_tokens if traced else None)


@functools.lru_cache(maxsize=64)
def _data_parallel(fn, mesh: Mesh, shared_names: tuple[str, ...], static_items: tuple):
    """`fn` (a jitted engine taking tokens, lens, key) with the batch's rows split over the mesh's
    data axis by `shard_map`. Inside, each device runs the engine's while_loop on its own rows, so
    its iteration count is its own (no cross-device sync per round); the model axis, if any, stays
    automatic, so GSPMD still partitions the target within each data shard. Cached: one compile
    per (engine, mesh, static arguments)."""
    static = dict(static_items)

    def per_shard(shared, tokens, lens, key):
        # Independent random streams per shard: the same prompt on two shards samples differently.
        key = jax.random.fold_in(key, jax.lax.axis_index("data"))
        return fn(**dict(zip(shared_names, shared)), tokens=tokens, lens=lens, key=key, **static)

    # With a model axis of 1 every axis is manual: each device then runs a plain one-device
    # program, which may use the GPU kernels (a pallas_call is not partitioned by GSPMD).
    manual = frozenset(mesh.axis_names) if axis_size(mesh, "model") == 1 else frozenset({"data"})
    mapped = jax.shard_map(
        per_shard, mesh=mesh, in_specs=(P(), P("data"), P("data"), P()), out_specs=P("data"),
        axis_names=manual, check_vma=False,
    )
    return jax.jit(mapped)


def _queue_per_shard(queue: tuple[int, int] | None, shards: int) -> dict:
    """The engines' rows / refill keywords for one of `shards` data shards, each serving its share of
    the prompts (continuous batching); none without a queue."""
    if not queue:
        return {}
    rows = -(-queue[0] // shards)
    return dict(rows=rows, refill=min(queue[1], rows))


def _items(static: dict) -> tuple:
    """Static keyword arguments as a hashable cache key."""
    return tuple(sorted(static.items(), key=lambda kv: kv[0]))


def _generate_data_parallel(mesh, params, cfg, tokens, lens, key, *, drafter, drafter_params, policy, policy_params,
                            k_max, verify, tree, max_new, cache_len, sampling, unroll, rows=None) -> GenerationResult:
    B, data = tokens.shape[0], axis_size(mesh, "data")
    padded = np.arange(-(-B // data) * data) % B  # pad to a multiple
    tokens, lens = tokens[padded], lens[padded]
    common = dict(max_new=max_new, cache_len=cache_len, sampling=sampling, unroll=unroll, **_queue_per_shard(rows, data))
    if drafter is None:
        fn = _data_parallel(generate_ar_jit, mesh, ("params",), _items(dict(cfg=cfg, **common)))
        out, n_out, steps = jax.device_get(fn((params,), tokens, lens, key))
        zeros = np.zeros_like(n_out)
        return GenerationResult(out[:B], n_out[:B], steps[:B], zeros[:B], zeros[:B], steps[:B])
    shared = ("tparams", "dparams", "policy_params")
    if tree is not None:
        if not isinstance(drafter, EagleDrafter):
            raise ValueError(f"tree drafting needs an EAGLE head drafter, got {getattr(drafter, 'name', drafter)!r}")
        policy = resolve_policy(policy, tree.depth)
        check_compatible(drafter, policy, cfg, tree.depth, "lossless")
        static = dict(tcfg=cfg, drafter=drafter, policy=policy, tree=tree, **common)
        fn = _data_parallel(tree_generate_jit, mesh, shared, _items(static))
    else:
        policy = resolve_policy(policy, k_max)
        check_compatible(drafter, policy, cfg, k_max, verify)
        static = dict(tcfg=cfg, drafter=drafter, policy=policy, k_max=k_max, verify=verify, **common)
        fn = _data_parallel(speculative_generate_jit, mesh, shared, _items(static))
    res = result_from_device(fn((params, drafter_params, policy_params), tokens, lens, key))
    return dataclasses.replace(res, **{  # drop the padding rows
        f.name: getattr(res, f.name)[:B] for f in dataclasses.fields(res) if isinstance(getattr(res, f.name), np.ndarray)
    })


def _generate_tensor_parallel(mesh, params, cfg, tokens, lens, key, *, drafter, drafter_params, policy, policy_params,
                              k_max, verify, tree, max_new, cache_len, sampling, unroll, policy_state,
                              queue=None) -> GenerationResult:
    """The generation under shard_map over the mesh (sharding.tensor_parallel_map): the target split
    per head over the model axis; with a data axis too, the rows split over it (each model group
    runs its own rows' while_loop); everything else replicated. `queue` (rows in flight, rows per
    refill): continuous batching, each data group over its share of the prompts."""
    n, groups = axis_size(mesh, "model"), axis_size(mesh, "data")
    local_cfg = tensor_parallel_config(cfg, n)  # a bad model=N fails here, before any weight moves
    if groups > 1 and policy_state is not None:
        raise ValueError("policy_state is not carried across data-parallel shards; run without a data mesh")
    B = tokens.shape[0]
    rows = np.arange(-(-B // groups) * groups) % B  # pad the batch to a multiple of the data axis
    specs = tensor_parallel_specs(params, cfg, n)
    params = placed_tensor_parallel(params, cfg, mesh)  # laid out once per weights and mesh
    split = ("tokens", "lens") if groups > 1 else ()
    common = dict(max_new=max_new, cache_len=cache_len, sampling=sampling, unroll=unroll, **_queue_per_shard(queue, groups))
    args = dict(tokens=jnp.asarray(tokens[rows]), lens=jnp.asarray(lens[rows]), key=key)
    if drafter is None:
        fn = tensor_parallel_map(generate_ar_jit, mesh, "params", specs, _items(dict(cfg=local_cfg, **common)), split)
        out, n_out, steps = (x[:B] for x in jax.device_get(fn(params, args)))
        zeros = np.zeros_like(n_out)
        return GenerationResult(out, n_out, steps, zeros, zeros, steps)
    args.update(dparams=None if drafter_params is None else replicate(drafter_params, mesh),
                policy_params=None if policy_params is None else replicate(policy_params, mesh))
    if groups == 1:  # the final policy state comes back (replicated) to carry on
        args.update(policy_state=policy_state)
    carry = dict(with_policy_state=groups == 1)
    if tree is not None:
        if not isinstance(drafter, (EagleDrafter, HybridDrafter)):
            raise ValueError(f"tree drafting needs an EAGLE head drafter (or eagle3+ngram), got "
                             f"{getattr(drafter, 'name', drafter)!r}")
        policy = resolve_policy(policy, tree.depth)
        check_compatible(drafter, policy, cfg, tree.depth, "lossless")
        static = dict(tcfg=local_cfg, drafter=drafter, policy=policy, tree=tree, **carry, **common)
        fn = tensor_parallel_map(tree_generate_jit, mesh, "tparams", specs, _items(static), split)
    else:
        policy, verify = resolve_policy(policy, k_max), resolve_verify(verify)
        check_compatible(drafter, policy, cfg, k_max, verify)
        static = dict(tcfg=local_cfg, drafter=drafter, policy=policy, k_max=k_max, verify=verify, **carry, **common)
        fn = tensor_parallel_map(speculative_generate_jit, mesh, "tparams", specs, _items(static), split)
    res = result_from_device(fn(params, args))
    if len(rows) == B:
        return res
    return dataclasses.replace(res, **{  # drop the padding rows
        f.name: getattr(res, f.name)[:B] for f in dataclasses.fields(res) if isinstance(getattr(res, f.name), np.ndarray)
    })


PARALLEL_ENGINES = ("pearl", "ppsd", "specbranch")
_GAMMAS: dict = {}  # (target cfg, draft cfg, batch, devices, dtype) -> measured γ


def _generate_parallel(engine, params, cfg, prompts, *, drafter, drafter_params, gamma, max_new, sampling, seed,
                       cache_len, mesh, hrad_params=None):
    if isinstance(engine, SpecBranchConfig):
        engine, sb = "specbranch", engine
    else:
        sb = SpecBranchConfig(**({"gamma": gamma} if gamma is not None else {}),
                              **({"cut": "hrad"} if hrad_params is not None else {}))
    if engine not in PARALLEL_ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose from {', '.join(PARALLEL_ENGINES)}")
    mesh = parse_role_mesh(mesh)
    if isinstance(drafter, str):
        drafter, drafter_params = build_drafter(drafter, cfg, params)
    groups = 1 if mesh is None else int(mesh.shape[ROLE_MESH_DATA])
    B = len(prompts)
    rows = np.arange(-(-B // groups) * groups) % B  # pad the batch to a multiple of the device pairs
    prompts = [prompts[i] for i in rows]
    key = jax.random.PRNGKey(seed)
    if hrad_params is not None and engine != "specbranch":
        raise ValueError(f"engine={engine!r} takes no policy_params (H-RAD weights are SpecBranch's)")
    if engine == "specbranch":
        if not isinstance(drafter, ModelDrafter):
            raise ValueError("engine='specbranch' drafts with a draft model: drafter='model:PATH' (or a ModelDrafter and its params)")
        drafter.check(cfg)
        tokens, lens, cache_len = pack_prompts(cfg, prompts, max_new, 2 * sb.gamma, cache_len)
        res = specbranch_generate(params, cfg, drafter_params, drafter.cfg, tokens, lens, key, sb=sb, max_new=max_new,
                                  cache_len=cache_len, sampling=sampling, hrad_params=hrad_params, mesh=mesh)
    elif engine == "pearl":
        if not isinstance(drafter, ModelDrafter):
            raise ValueError("engine='pearl' drafts with a draft model: drafter='model:PATH' (or a ModelDrafter and its params)")
        drafter.check(cfg)
        if gamma is None:
            devices = tuple(mesh.devices[0]) if mesh is not None else tuple(jax.devices()[:1])
            k = (cfg, drafter.cfg, len(prompts) // groups, tuple(d.id for d in devices), str(params["embed"].dtype))
            if k not in _GAMMAS:
                _GAMMAS[k] = measure_gamma(params, cfg, drafter_params, drafter.cfg, batch=k[2], devices=devices)[0]
            gamma = _GAMMAS[k]
        tokens, lens, cache_len = pack_prompts(cfg, prompts, max_new, 2 * gamma, cache_len)
        res = pearl_generate(params, cfg, drafter_params, drafter.cfg, tokens, lens, key, gamma=gamma, max_new=max_new,
                             cache_len=cache_len, sampling=sampling, mesh=mesh)
    else:
        if not isinstance(drafter, EarlyExitDrafter):
            raise ValueError("engine='ppsd' drafts with the target's first layers: drafter='early-exit:PATH' (a trained "
                             "exit head) or 'early-exit:E' (untrained)")
        if gamma is not None:
            raise ValueError("gamma is PEARL's window; PPSD drafts one token a tick")
        drafter.check(cfg)
        tokens, lens, cache_len = pack_prompts(cfg, prompts, max_new, 1, cache_len)
        res = ppsd_generate(params, cfg, drafter_params, drafter.head, drafter.exit_layer, tokens, lens, key,
                            max_new=max_new, cache_len=cache_len, sampling=sampling, mesh=mesh)
    if len(rows) == B:
        return res
    return dataclasses.replace(res, **{  # drop the padding rows
        f.name: getattr(res, f.name)[:B] for f in dataclasses.fields(res) if isinstance(getattr(res, f.name), np.ndarray)
    })


def pack_stream_prompt(cfg: ModelConfig, prompt: list[int], max_new_tokens: int, extra: int = 0, drafter=None):
    """pack_prompts for one streamed prompt, its cache rounded as `generate` rounds a batch's
    (shared_cache_len, where attention reads only committed slots): prompts streamed in turn by
    the CLI share one decode loop's program across nearby prompt buckets."""
    cache_len = None
    if _attention_reads_committed_slots(cfg, extra, drafter):
        cache_len = shared_cache_len(bucket(len(prompt)), max_new_tokens, extra)
    return pack_prompts(cfg, [prompt], max_new_tokens, extra, cache_len)


def generate_stream(
    params: dict,
    cfg: ModelConfig,
    prompt: list[int],
    *,
    max_new_tokens: int = 128,
    sampling: Sampling | None = None,
    seed: int = 0,
    chunk: int = 8,
    unroll: int | bool | None = None,
) -> Iterator[list[int]]:
    """Yield new tokens as they come, `chunk` jitted decode steps at a time (one host sync per chunk)."""
    sampling = sampling or GREEDY
    enable_default_compile_cache()
    tokens, lens, cache_len = pack_stream_prompt(cfg, prompt, max_new_tokens)
    with M.per_device_program():  # one device: GPU kernels even on a host with several GPUs
        state = start_decode_jit(
            params, cfg, jnp.asarray(tokens), jnp.asarray(lens), jax.random.PRNGKey(seed),
            max_new=max_new_tokens, cache_len=cache_len, sampling=sampling, unroll=unroll,
        )

    def advance(st):
        with M.per_device_program():
            return decode_loop_jit(params, cfg, st, max_new=max_new_tokens, sampling=sampling, n_steps=chunk,
                                   unroll=unroll)

    for tokens, _ in stream_row0(state, advance):
        yield tokens
