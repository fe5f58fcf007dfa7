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


@pytest.mark.parametrize("seed,B,K,C,beam,quantize", [
    (0, 3, 16, 7, 3, False), (1, 2, 16, 7, 3, True), (2, 2, 5, 4, 1, False), (3, 2, 9, 3, 4, True),
    (4, 1, 30, 16, 3, False)])
def test_pallas_search_matches_the_portable_search(seed, B, K, C, beam, quantize):
    tokens, logq, ok, table, limit = lattice(seed, B, K, C, quantize=quantize)
    kw = dict(beam=beam, lam=0.5, eos_id=5)
    want = jax.jit(lambda *a: CS.search_portable(*a, **kw))(tokens, logq, ok, table, limit)
    got = CS.search_pallas(tokens, logq, ok, table, limit, interpret=True, **kw)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    for b in range(B):  # the path up to its length (the slots past it hold the beams' leftovers in both)
        n = int(want[1][b])
        np.testing.assert_array_equal(np.asarray(got[0][b, :n]), np.asarray(want[0][b, :n]))
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-6)


def test_search_dispatches_by_impl():
    tokens, logq, ok, table, limit = lattice(5, 1, 4, 3)
    with pytest.raises(ValueError, match="impl 'cuda': expected one of xla, pallas"):
        CS.search(tokens, logq, ok, table, limit, beam=2, lam=0.5, eos_id=5, impl="cuda")


def test_pallas_search_lowers_to_triton_without_a_gpu():
    tokens, logq, ok, table, limit = lattice(6, 2, 16, 7)
    fn = jax.jit(lambda *a: CS.search_pallas(*a, beam=3, lam=0.5, eos_id=5))
    exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(tokens, logq, ok, table, limit)
    assert "jspec_cps_search" in exported.mlir_module()
