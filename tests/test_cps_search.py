"""kernels/cps_search.py: the one-kernel CPS beam search (Pallas, interpret mode on the CPU) gives the
portable search's path, length and score, ties included, and lowers to Triton for a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.kernels import cps_search as CS


def lattice(seed, B, K, C, *, eos_id=5, quantize=False):
    """Random lattice and proxy table; quantized scores make ties common."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 12, (B, K, C)).astype(np.int32)
    tokens[..., -1] = eos_id  # CPS's EOS slot
    logq = np.log(rng.dirichlet(np.ones(C), (B, K))).astype(np.float32)
    table = rng.normal(-3.0, 1.0, (B, K, C, C, C)).astype(np.float32)
    if quantize:
        logq, table = np.round(logq), np.round(table)
    ok = rng.random((B, K, C)) < 0.7
    ok[..., 0] = True
    ok[..., -1] = True
    logq[rng.random((B, K, C)) < 0.05] = -np.inf  # an EOS the DLM gives no mass
    limit = rng.integers(0, K + 1, (B,)).astype(np.int32)
    limit[0] = K
    return tuple(jnp.asarray(x) for x in (tokens, logq, ok, table, limit))


@pytest.mark.parametrize("seed,B,K,C,beam,quantize,objective", [
    (0, 3, 16, 7, 3, False, "logprob"), (1, 2, 16, 7, 3, True, "logprob"), (2, 2, 5, 4, 1, False, "logprob"),
    (3, 2, 9, 3, 4, True, "logprob"), (4, 1, 30, 16, 3, False, "logprob"), (5, 3, 16, 7, 3, False, "expected"),
    (6, 2, 9, 3, 4, True, "expected")])
def test_pallas_search_matches_the_portable_search(seed, B, K, C, beam, quantize, objective):
    tokens, logq, ok, table, limit = lattice(seed, B, K, C, quantize=quantize)
    kw = dict(beam=beam, lam=0.5, eos_id=5, objective=objective)
    want = jax.jit(lambda *a: CS.search_portable(*a, **kw))(tokens, logq, ok, table, limit)
    got = CS.search_pallas(tokens, logq, ok, table, limit, interpret=True, **kw)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    for b in range(B):  # the path up to its length (the slots past it hold the beams' leftovers in both)
        n = int(want[1][b])
        np.testing.assert_array_equal(np.asarray(got[0][b, :n]), np.asarray(want[0][b, :n]))
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-6)


def test_search_dispatches_by_impl():
    tokens, logq, ok, table, limit = lattice(5, 1, 4, 3)
    kw = dict(beam=2, lam=0.5, eos_id=5)
    got = CS.search(tokens, logq, ok, table, limit, impl="pallas", **kw)  # off a GPU: the Pallas interpreter
    want = CS.search(tokens, logq, ok, table, limit, impl="xla", **kw)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    with pytest.raises(ValueError, match="impl 'cuda': expected one of xla, pallas"):
        CS.search(tokens, logq, ok, table, limit, beam=2, lam=0.5, eos_id=5, impl="cuda")
    with pytest.raises(ValueError, match="objective 'mean': expected one of logprob, expected"):
        CS.search(tokens, logq, ok, table, limit, beam=2, lam=0.5, eos_id=5, objective="mean")


def test_expected_objective_scores_the_expected_accepted_length():
    """One row, beam wide enough to keep every path: the best path's score is its sum over k of the
    product of its first k weights, EOS adding nothing, and no other lattice path scores higher."""
    import itertools
    tokens, logq, ok, table, limit = lattice(7, 1, 3, 3, eos_id=5)
    ok = jnp.ones_like(ok)
    limit = jnp.asarray([3])
    path, length, score = CS.search_portable(tokens, logq, ok, table, limit, beam=27, lam=0.5, eos_id=5,
                                             objective="expected")
    t, lq, tab = np.asarray(tokens)[0], np.asarray(logq)[0], np.asarray(table)[0]

    def value(choice):  # choice: lattice indices, a path that stops at its first EOS
        total, logw, prev2, prev1 = 0.0, 0.0, 0, 0
        for k, c in enumerate(choice):
            logw += 0.5 * lq[k, c] + 0.5 * tab[k, prev2, prev1, c]
            if t[k, c] == 5:
                return total, k + 1
            total += np.exp(logw)
            prev2, prev1 = prev1, c
        return total, len(choice)

    best = max(value(ch)[0] for ch in itertools.product(range(3), repeat=3))
    np.testing.assert_allclose(float(score[0]), best, rtol=1e-5)


def test_pallas_search_lowers_to_triton_without_a_gpu():
    tokens, logq, ok, table, limit = lattice(6, 2, 16, 7)
    fn = jax.jit(lambda *a: CS.search_pallas(*a, beam=3, lam=0.5, eos_id=5))
    exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(tokens, logq, ok, table, limit)
    assert "jspec_cps_search" in exported.mlir_module()
