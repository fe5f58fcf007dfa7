"""Each method's whole generation as one jitted program and the arguments it is called with, as
`generate()` calls it: what the export tests lower for TPU and CUDA (tests/test_export.py) and what
scripts/bench_compile.py compiles and times.

A `Program`'s arguments may be arrays or `jax.ShapeDtypeStruct`s (`abstract`): lowering, exporting
and compiling need only shapes; running needs arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from ..decode import decode_loop_jit, generate_ar_jit, pack_prompts, start_decode_jit
from ..sampling import GREEDY, Sampling
from ..speculative.engines.chain import check_compatible, generation_program, loop_program, start_spec_jit
from ..speculative.engines.pearl import check_pearl, pearl_one_device_jit
from ..speculative.engines.tree import TreeConfig, tree_for, tree_generate_jit, tree_loop_jit
from ..speculative.policies import resolve_policy


@dataclasses.dataclass(frozen=True)
class Program:
    """A jitted function (`fn`), its positional arguments and its static keyword arguments."""

    name: str
    fn: Any
    args: tuple
    static: dict

    def trace(self):
        return self.fn.trace(*self.args, **self.static)

    def export(self, platforms: tuple[str, ...], disabled_checks=()) -> jax.export.Exported:
        """The program lowered for `platforms` (no device of theirs needed, nothing compiled)."""
        return jax.export.export(self.fn, platforms=platforms, disabled_checks=disabled_checks)(*self.args, **self.static)


def abstract(tree):
    """Shapes and dtypes of a pytree of arrays (what lowering needs, no memory)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def prompt_inputs(cfg: ModelConfig, batch: int, prompt_len: int, max_new: int, extra: int = 0):
    """tokens [batch, bucket], lens [batch], cache_len and a key for `batch` prompts of
    `prompt_len` tokens, packed as generate() packs them."""
    prompts = [[(7 + i + t) % cfg.vocab_size for t in range(prompt_len)] for i in range(batch)]
    tokens, lens, cache_len = pack_prompts(cfg, prompts, max_new, extra)
    return jnp.asarray(tokens), jnp.asarray(lens), cache_len, jax.random.PRNGKey(0)


def ar_program(params, cfg: ModelConfig, *, batch: int = 1, prompt_len: int = 32, max_new: int = 64,
               sampling: Sampling = GREEDY, unroll=None) -> Program:
    tokens, lens, cache_len, key = prompt_inputs(cfg, batch, prompt_len, max_new)
    return Program("ar", generate_ar_jit, (params, cfg, tokens, lens, key),
                   dict(max_new=max_new, cache_len=cache_len, sampling=sampling, unroll=unroll))


def chain_program(params, cfg: ModelConfig, drafter, dparams, *, policy="static", policy_params=None, k_max: int = 6,
                  batch: int = 1, prompt_len: int = 32, max_new: int = 64, sampling: Sampling = GREEDY,
                  unroll=None, name: str = "chain") -> Program:
    policy = resolve_policy(policy, k_max)
    check_compatible(drafter, policy, cfg, k_max, "lossless")
    tokens, lens, cache_len, key = prompt_inputs(cfg, batch, prompt_len, max_new, k_max + 1)
    return Program(name, generation_program(policy), (params, dparams, policy_params, tokens, lens, key),
                   dict(tcfg=cfg, drafter=drafter, policy=policy, k_max=k_max, max_new=max_new, cache_len=cache_len,
                        sampling=sampling, verify="lossless", unroll=unroll))


def tree_program(params, cfg: ModelConfig, drafter, dparams, *, tree: TreeConfig = TreeConfig(), policy="static",
                 batch: int = 1, prompt_len: int = 32, max_new: int = 64, sampling: Sampling = GREEDY,
                 unroll=None, name: str = "tree") -> Program:
    tree = tree_for(drafter, tree)
    policy = resolve_policy(policy, tree.depth)
    check_compatible(drafter, policy, cfg, tree.depth, "lossless")
    tokens, lens, cache_len, key = prompt_inputs(cfg, batch, prompt_len, max_new, tree.cache_slots)
    return Program(name, tree_generate_jit, (params, dparams, None, tokens, lens, key),
                   dict(tcfg=cfg, drafter=drafter, policy=policy, tree=tree, max_new=max_new, cache_len=cache_len,
                        sampling=sampling, unroll=unroll))


def ar_loop_program(params, cfg: ModelConfig, *, batch: int = 1, prompt_len: int = 32, max_new: int = 64,
                    sampling: Sampling = GREEDY, unroll=None) -> Program:
    """AR's decode loop alone: what one batch runs after its prefill (`start_decode_jit`), one
    program for every prompt width of a cache length."""
    tokens, lens, cache_len, key = prompt_inputs(cfg, batch, prompt_len, max_new)
    static = dict(max_new=max_new, sampling=sampling, unroll=unroll)
    state = jax.eval_shape(lambda: start_decode_jit(params, cfg, tokens, lens, key, cache_len=cache_len, **static))
    return Program("ar-loop", decode_loop_jit, (params, cfg, state), static)


def chain_loop_program(params, cfg: ModelConfig, drafter, dparams, *, policy="static", k_max: int = 6, batch: int = 1,
                       prompt_len: int = 32, max_new: int = 64, sampling: Sampling = GREEDY, unroll=None) -> Program:
    """The chain's rounds alone (after `start_spec_jit`), as `chain_program`'s."""
    policy = resolve_policy(policy, k_max)
    check_compatible(drafter, policy, cfg, k_max, "lossless")
    tokens, lens, cache_len, key = prompt_inputs(cfg, batch, prompt_len, max_new, k_max + 1)
    static = dict(tcfg=cfg, drafter=drafter, policy=policy, k_max=k_max, max_new=max_new, sampling=sampling,
                  verify="lossless", unroll=unroll)
    state = jax.eval_shape(lambda: start_spec_jit(params, dparams, None, tokens, lens, key, cache_len=cache_len, **static))
    return Program("chain-loop", loop_program(policy), (params, dparams, state), static)


def tree_loop_program(params, cfg: ModelConfig, drafter, dparams, *, tree: TreeConfig = TreeConfig(), policy="static",
                      batch: int = 1, prompt_len: int = 32, max_new: int = 64, sampling: Sampling = GREEDY,
                      unroll=None) -> Program:
    """The tree's rounds alone (after `start_spec_jit` at k_max = depth), as `tree_program`'s."""
    tree = tree_for(drafter, tree)
    policy = resolve_policy(policy, tree.depth)
    check_compatible(drafter, policy, cfg, tree.depth, "lossless")
    tokens, lens, cache_len, key = prompt_inputs(cfg, batch, prompt_len, max_new, tree.cache_slots)
    static = dict(tcfg=cfg, drafter=drafter, policy=policy, max_new=max_new, sampling=sampling, unroll=unroll)
    state = jax.eval_shape(lambda: start_spec_jit(params, dparams, None, tokens, lens, key, k_max=tree.depth,
                                                  cache_len=cache_len, verify="lossless", **static))
    return Program("tree-loop", tree_loop_jit, (params, dparams, state), dict(tree=tree, **static))


def pearl_program(params, cfg: ModelConfig, dparams, dcfg: ModelConfig, *, gamma: int = 4, batch: int = 1,
                  prompt_len: int = 32, max_new: int = 64, sampling: Sampling = GREEDY) -> Program:
    """PEARL on one device (both roles in turn)."""
    check_pearl(cfg, dcfg, gamma)
    tokens, lens, cache_len, key = prompt_inputs(cfg, batch, prompt_len, max_new, 2 * gamma)
    return Program("pearl", pearl_one_device_jit, (params, dparams, tokens, lens, key),
                   dict(tcfg=cfg, dcfg=dcfg, gamma=gamma, max_new=max_new, cache_len=cache_len, sampling=sampling,
                        kernels=None))
