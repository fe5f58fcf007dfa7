"""The parallel engines (PEARL, SpecBranch, PPSD) run one program over a ("data", "role") mesh in
which each device takes a role via `lax.cond` on `axis_index`. On GPUs every device must execute
the same collectives in the same order, or one waits in a ppermute its partner never reaches (an
XLA rendezvous timeout, then an abort). CPU runs can pass anyway, so this checks the structure of
the lowered StableHLO instead of running it: no collective inside a `case`/`if` region (a branch
that one device takes and another skips), and every while loop with collectives in its body has a
condition that all-reduces (over the data groups, so every group leaves the loop on the same step;
the two roles of a pair agree because both apply one decision, see pearl.still_running). Lowering
only: no compile, no run; plus the packed exchange (one collective, bit-exact)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jspec import model as M
from jspec.config import ModelConfig
from jspec.decode import pack_prompts
from jspec.heads import draft_model as DM
from jspec.heads import exit_head as EH
from jspec.sampling import GREEDY, Sampling
from jspec.speculative.engines import pearl as PE
from jspec.speculative.engines import ppsd as PP
from jspec.speculative.engines import specbranch as SB

CFG = ModelConfig(
    arch="llama", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=4,
    num_heads=4, num_kv_heads=2, head_dim=8, eos_token_ids=(3,), max_position_embeddings=512,
)
MAX_NEW = 8
COLLECTIVES = {"stablehlo.collective_permute", "stablehlo.all_reduce", "stablehlo.all_gather", "stablehlo.all_to_all",
               "stablehlo.reduce_scatter", "stablehlo.collective_broadcast"}
BRANCHING = {"stablehlo.case", "stablehlo.if"}


# ---------------------------------------------------------------------------------------------
# The checker: a walk over the lowered module's operations (calls into private functions followed)
# ---------------------------------------------------------------------------------------------


def _children(op):
    for region in op.operation.regions:
        for block in region.blocks:
            yield from block.operations


def _callee(op):
    return str(op.operation.attributes["callee"]).lstrip("@") if op.operation.name == "func.call" else None


def _funcs(module):
    return {str(op.operation.attributes["sym_name"]).strip('"'): op for op in module.body.operations
            if op.operation.name == "func.func"}


def _contains(ops, names, funcs, seen=None):
    """Whether any of `ops`, their nested regions or the functions they call is named in `names`."""
    seen = set() if seen is None else seen
    for op in ops:
        if op.operation.name in names:
            return True
        callee = _callee(op)
        if callee is not None and callee not in seen:
            seen.add(callee)
            if _contains(_children(funcs[callee]), names, funcs, seen):
                return True
        if _contains(_children(op), names, funcs, seen):
            return True
    return False


def collective_problems(module) -> list[str]:
    """Where devices of one program could run different collectives: a collective in a branch,
    or a loop with collectives whose exit is not decided by an all-reduce."""
    funcs = _funcs(module)
    problems = []

    def visit(op, in_branch, path):
        name = op.operation.name
        if name in COLLECTIVES and in_branch:
            problems.append(f"{name} inside a branch ({' > '.join(path)})")
        if name == "stablehlo.while":
            cond_region, body_region = op.operation.regions
            body_ops = [o for b in body_region.blocks for o in b.operations]
            cond_ops = [o for b in cond_region.blocks for o in b.operations]
            if _contains(body_ops, COLLECTIVES, funcs) and not _contains(cond_ops, {"stablehlo.all_reduce"}, funcs):
                problems.append(f"while loop with collectives whose condition is not all-reduced ({' > '.join(path)})")
        callee = _callee(op)
        if callee is not None:
            for child in _children(funcs[callee]):
                visit(child, in_branch, path + [f"call {callee}"])
        for child in _children(op):
            visit(child, in_branch or name in BRANCHING, path + [name])

    for child in _children(funcs["main"]):
        visit(child, False, ["main"])
    return problems


# ---------------------------------------------------------------------------------------------
# The checker catches the bug class (toy programs), and the engines are free of it
# ---------------------------------------------------------------------------------------------


def _mesh(data=1):
    return Mesh(np.asarray(jax.devices()[: 2 * data]).reshape(data, 2), (PE.DATA_AXIS, PE.ROLE_AXIS))


def _lower_toy(step):
    fn = jax.shard_map(step, mesh=_mesh(), in_specs=P(PE.DATA_AXIS), out_specs=P(PE.DATA_AXIS), check_vma=False)
    return jax.jit(fn).lower(jnp.zeros((2,))).compiler_ir("stablehlo")


def _swap(x):
    return jax.lax.ppermute(x, PE.ROLE_AXIS, [(0, 1), (1, 0)])


def test_checker_flags_a_collective_in_a_role_branch():
    def step(x):
        return jax.lax.cond(jax.lax.axis_index(PE.ROLE_AXIS) == 0, _swap, lambda x: x, x)
    assert any("inside a branch" in p for p in collective_problems(_lower_toy(step)))


def test_checker_flags_a_loop_exit_taken_per_device():
    def step(x):
        return jax.lax.while_loop(lambda x: x[0] < 3, lambda x: _swap(x) + 1, x)
    assert any("not all-reduced" in p for p in collective_problems(_lower_toy(step)))

    def uniform(x):
        return jax.lax.while_loop(lambda x: PE.still_running(x >= 3, True), lambda x: _swap(x) + 1, x)
    assert collective_problems(_lower_toy(uniform)) == []


@pytest.fixture(scope="module")
def models():
    tparams = M.init_params(CFG, jax.random.PRNGKey(0), scale=0.35)
    dcfg, dparams = DM.init_from_target(tparams, CFG, (0, 3))
    ecfg, eparams = EH.init_from_target(tparams, CFG, 2)
    return tparams, dcfg, dparams, ecfg, eparams


def _lowered(engine, models, sampling, data):
    tparams, dcfg, dparams, ecfg, eparams = models
    mesh = _mesh(data)
    gamma = 3
    tokens, lens, cache_len = pack_prompts(CFG, [[5, 6, 7], [8, 9]] * data, MAX_NEW, 2 * gamma)
    tokens, lens, key = jnp.asarray(tokens), jnp.asarray(lens), jax.random.PRNGKey(0)
    if engine == "pearl":
        fn = PE._two_device_fn(mesh, CFG, dcfg, gamma, MAX_NEW, cache_len, sampling, None)
        args = (tparams, dparams, tokens, lens, key)
    elif engine == "specbranch":
        sb = SB.SpecBranchConfig(branches=2, gamma=gamma)
        fn = SB._two_device_fn(mesh, CFG, dcfg, sb, MAX_NEW, cache_len, sampling, None)
        args = (tparams, dparams, None, tokens, lens, key)
    else:
        fn = PP._two_device_fn(mesh, CFG, ecfg, 2, MAX_NEW, cache_len, sampling, None)
        args = (tparams, eparams, tokens, lens, key)
    return fn.lower(*args).compiler_ir("stablehlo")


@pytest.mark.parametrize("engine", ["pearl", "specbranch", "ppsd"])
@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=1.0)], ids=["greedy", "sampling"])
def test_engines_run_the_same_collectives_on_every_device(models, engine, sampling):
    module = _lowered(engine, models, sampling, data=1)
    assert collective_problems(module) == []
    funcs = _funcs(module)
    assert _contains(_children(funcs["main"]), {"stablehlo.collective_permute"}, funcs)  # the check saw the exchanges


@pytest.mark.parametrize("engine", ["pearl", "specbranch", "ppsd"])
def test_engines_on_four_data_groups(models, engine):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake) devices")
    assert collective_problems(_lowered(engine, models, GREEDY, data=4)) == []


def test_packed_exchange_is_one_collective_and_bit_exact():
    """ppermute_packed swaps a pytree of floats (denormals, bf16), ints, bools and None as one
    collective permute, every bit intact."""
    tree = {"f": jnp.array([[1.5e-40, -0.0, 3.25]], jnp.float32), "h": jnp.array([[0.1, -2.5]], jnp.bfloat16),
            "i": jnp.array([[7, -(2 ** 31)]], jnp.int32), "b": jnp.array([[True, False]]), "none": None}

    def step(x):
        role = jax.lax.axis_index(PE.ROLE_AXIS)
        mine = {**tree, "i": tree["i"] + role}
        return PE.ppermute_packed(mine, PE.ROLE_AXIS, [(0, 1), (1, 0)]), x

    fn = jax.jit(jax.shard_map(step, mesh=_mesh(), in_specs=P(PE.DATA_AXIS), out_specs=(P(PE.ROLE_AXIS), P(PE.DATA_AXIS)),
                               check_vma=False))
    text = fn.lower(jnp.zeros((2,))).compiler_ir("stablehlo")
    assert str(text).count("stablehlo.collective_permute") == 1
    got, _ = fn(jnp.zeros((2,)))
    assert got["none"] is None
    got = jax.tree.map(np.asarray, got)  # compare on the host: an XLA:CPU slice would flush the denormal
    np.testing.assert_array_equal(got["f"][:1].view(np.uint32), np.asarray(tree["f"]).view(np.uint32))
    np.testing.assert_array_equal(got["h"][:1].view(np.uint16), np.asarray(tree["h"]).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(got["i"]), np.concatenate([tree["i"] + 1, tree["i"]]))  # swapped
    np.testing.assert_array_equal(got["b"][:1], np.asarray(tree["b"]))
