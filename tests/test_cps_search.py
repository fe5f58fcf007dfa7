"""kernels/cps_search.py: the one-kernel CPS beam search (Pallas, interpret mode on the CPU) gives the
portable search's path, length and score, ties included, both give what the search's definition
gives (a plain-Python beam search) on 208 randomized lattices, and the kernel lowers to Triton for a GPU."""

import math

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


def reference_search(tokens, logq, ok, table, limit, *, beam, lam, eos_id, objective):
    """The beam search `search_portable`'s docstring defines, one row at a time in plain Python
    (float64): W slots, a dead one scored -inf; a position's candidates in the documented order
    (slot w extended by candidate c at w * C + c, then each slot kept unchanged), the W best by a
    stable sort (ties: the earlier candidate). Per row: (the best final score, the path of the
    first slot scoring it, the paths of every final slot within rounding of it)."""
    B, K, C = tokens.shape

    def weight(lq, proxy):  # a term of coefficient 0 is absent: q^1 P^0 = q, even where P = 0
        return (lam * lq if lam != 0.0 else 0.0) + ((1.0 - lam) * proxy if lam != 1.0 else 0.0)

    rows = []
    for b in range(B):
        # a slot: (score, log product of its weights, path, finished, lattice index two back, one back)
        slots = [(0.0, 0.0, (), False, 0, 0)] + [(-math.inf, 0.0, (), False, 0, 0)] * (beam - 1)
        for k in range(K):
            expanding = k < limit[b]
            cands = []
            for score, logw, path, fin, i2, i1 in slots:
                for c in range(C):
                    w = weight(float(logq[b, k, c]), float(table[b, k, i2, i1, c]))
                    tok = int(tokens[b, k, c])
                    gain = (0.0 if tok == eos_id else math.exp(logw + w)) if objective == "expected" else w
                    taken = score > -math.inf and not fin and bool(ok[b, k, c]) and expanding
                    cands.append((score + gain if taken else -math.inf, logw + w, path + (tok,), tok == eos_id, i1, c))
            for score, logw, path, fin, i2, i1 in slots:
                kept = score > -math.inf and (fin or not expanding)
                cands.append((score if kept else -math.inf, logw, path, fin, i2, i1))
            slots = sorted(cands, key=lambda cand: -cand[0])[:beam]  # stable
        best = max(s[0] for s in slots)
        tied = {s[2] for s in slots if s[0] == best or math.isclose(s[0], best, rel_tol=1e-5, abs_tol=1e-6)}
        rows.append((best, next(s[2] for s in slots if s[0] == best), tied))
    return rows


LAMS = (0.0, 1.0, 0.5, 0.3, 0.0, 1.0, 0.7, 0.5, 0.0, 1.0)  # one per group: 0 and 1 (a term dropped) three times each


def random_lattices(seed, rows):
    """`rows` random lattices of one randomly drawn shape, beam and objective and the group's lam
    (LAMS), so that a group compiles once: ties (rounded scores in half the rows), masked cells
    (ok False, log q -inf, proxy -inf), EOS anywhere, ragged limits down to 0. Three rows in four
    keep one path open (each position's first cell ok with a finite weight, limit >= 1), so most
    rows test a real search rather than one where no path survives."""
    rng = np.random.default_rng(seed)
    K, C, beam = int(rng.integers(1, 9)), int(rng.integers(1, 7)), int(rng.integers(1, 6))
    kw = dict(beam=beam, lam=LAMS[seed % len(LAMS)], eos_id=5, objective=str(rng.choice(CS.OBJECTIVES)))
    tokens = rng.integers(0, 8, (rows, K, C)).astype(np.int32)
    logq = np.log(rng.dirichlet(np.ones(C), (rows, K))).astype(np.float32)
    table = rng.normal(-2.0, 1.0, (rows, K, C, C, C)).astype(np.float32)
    tied = rng.random(rows) < 0.5
    logq[tied], table[tied] = np.round(logq[tied]), np.round(table[tied])
    ok = rng.random((rows, K, C)) < rng.uniform(0.2, 1.0, (rows, 1, 1))
    logq[rng.random((rows, K, C)) < 0.1] = -np.inf
    table[(rng.random(table.shape) < 0.1) & (rng.random((rows, 1, 1, 1, 1)) < 0.5)] = -np.inf
    limit = rng.integers(0, K + 1, (rows,)).astype(np.int32)
    live = rng.random(rows) < 0.75
    ok[live, :, 0] = True
    logq[live, :, 0] = np.where(np.isfinite(logq[live, :, 0]), logq[live, :, 0], -1.0)
    table[live, ..., 0] = np.where(np.isfinite(table[live, ..., 0]), table[live, ..., 0], -2.0)
    limit[live] = np.maximum(limit[live], 1)
    return (tokens, logq, ok, table, limit), kw


RANDOM_GROUPS, RANDOM_ROWS = 10, 32  # 320 lattices
MIN_LIVE_ROWS = 20  # per group: rows whose best path is finite and at least one token long (>= 200 in all)


@pytest.mark.parametrize("seed", range(RANDOM_GROUPS))
def test_both_searches_give_the_definitions_best_path_on_random_lattices(seed):
    """Kernel and portable search against the plain-Python beam search: the same best score
    (within float32 rounding) and length, and the same path (where the best score is tied between
    final beams: one of the tied paths). Groups with lam 0 or 1 and a -inf log q or proxy are the
    cases where both searches used to compute 0 * -inf = nan and disagree (`log_weight`)."""
    lattice, kw = random_lattices(seed, RANDOM_ROWS)
    want = reference_search(*lattice, **kw)
    args = tuple(jnp.asarray(x) for x in lattice)
    portable = jax.jit(lambda *a: CS.search_portable(*a, **kw))(*args)
    kernel = CS.search_pallas(*args, interpret=True, **kw)
    assert sum(best > -math.inf and len(first) > 0 for best, first, _ in want) >= MIN_LIVE_ROWS
    for name, (path, length, score) in (("portable", portable), ("pallas", kernel)):
        path, length, score = np.asarray(path), np.asarray(length), np.asarray(score)
        for b, (best, first, tied) in enumerate(want):
            got = tuple(int(t) for t in path[b, : max(int(length[b]), 0)])
            where = f"{name}, row {b} ({kw}, limit {lattice[4][b]})"
            assert score[b] == best or math.isclose(score[b], best, rel_tol=1e-5, abs_tol=1e-6), (where, score[b], best)
            assert got == first or (len(tied) > 1 and got in tied), (where, got, first)


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
