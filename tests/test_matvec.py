"""The matvec kernel (jspec/kernels/matvec.py) against XLA's dot, in Pallas interpret mode on CPU,
and its block choice (tuning table, in-place weights, JSPEC_MATMUL)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.kernels import matvec as MV


def _rand(key, shape):
    return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32)


@pytest.mark.parametrize("layout", ["kn", "nk", "stacked"])
@pytest.mark.parametrize("rows,K,N", [(1, 64, 96), (3, 100, 70), (17, 130, 33)])  # tails in K and N; 2 row tiles
def test_matvec_matches_dot(layout, rows, K, N):
    x = _rand(0, (rows, K))
    if layout == "stacked":
        w = _rand(1, (3, K, N))
        ref, kw = x @ w[2], dict(layer=jnp.int32(2))
    elif layout == "nk":
        w = _rand(1, (N, K))
        ref, kw = x @ w.T, dict(transposed=True)
    else:
        w = _rand(1, (K, N))
        ref, kw = x @ w, {}
    for blocks in (MV.Blocks(16, 32, 1, 4, 3), MV.Blocks(32, 32, 3, 4, 3)):  # whole K; split K (last split short)
        got = MV.matvec(x, w, blocks=blocks, interpret=True, **kw)
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="does not match W"):
        MV.matvec(_rand(0, (rows, K + 1)), w, blocks=MV.Blocks(16, 32, 1, 4, 3), interpret=True, **kw)


def test_matvec_gradient_is_xlas():
    x, w = _rand(2, (2, 3, 40)), _rand(3, (24, 40))
    f = lambda x, w: jnp.sum(jnp.sin(MV.matvec(x, w, transposed=True, blocks=MV.Blocks(16, 32, 2, 4, 3),  # noqa: E731
                                                interpret=True)))
    g = lambda x, w: jnp.sum(jnp.sin(x @ w.T))  # noqa: E731
    for a, b in zip(jax.grad(f, (0, 1))(x, w), jax.grad(g, (0, 1))(x, w)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_block_choice(monkeypatch, tmp_path):
    table = tmp_path / "t.json"
    key_fast = MV.tuning_key(1, 4096, 4096, False, jnp.bfloat16)
    key_slow = MV.tuning_key(1, 4096, 8192, False, jnp.bfloat16)
    table.write_text('{"cpu": {"%s": {"blocks": [64, 128, 4, 4, 4], "xla_faster": false},'
                     ' "%s": {"blocks": [128, 128, 2, 4, 3], "xla_faster": true}}}' % (key_fast, key_slow))
    monkeypatch.setenv("JSPEC_MATVEC_TUNING", str(table))
    monkeypatch.setattr(MV, "card_name", lambda: "cpu")
    MV._tuning_table.cache_clear()
    try:
        monkeypatch.setenv("JSPEC_MATMUL", "auto")
        assert MV.pick_blocks(1, 4096, 4096, transposed=False) == (64, 128, 4, 4, 4)
        assert MV.pick_blocks(1, 4096, 8192, transposed=False) is None  # XLA measured faster on its own buffer
        assert MV.pick_blocks(1, 4096, 8192, transposed=False, in_place=True) == (128, 128, 2, 4, 3)  # XLA would copy
        assert MV.pick_blocks(2, 64, 64, transposed=False) is None  # untuned and small: launch-bound, XLA
        # ... but at one row XLA's multiply-and-reduce lowering loses: the kernel, K split over the card
        assert MV.pick_blocks(1, 576, 576, transposed=False) == MV.default_blocks(1, 576, 576, transposed=False, sms=132) == (64, 128, 4, 4, 4)
        assert MV.pick_blocks(1, 64, 64, transposed=False, in_place=True) is not None
        assert MV.pick_blocks(MV.MAX_ROWS + 1, 4096, 4096, transposed=False, in_place=True) is None
        assert MV.tuning_key(1, 8, 8, False, jnp.bfloat16) != MV.tuning_key(2, 8, 8, False, jnp.bfloat16)
        monkeypatch.setenv("JSPEC_MATMUL", "xla")
        assert MV.pick_blocks(1, 4096, 4096, transposed=False, in_place=True) is None
        monkeypatch.setenv("JSPEC_MATMUL", "matvec")
        assert MV.pick_blocks(1, 4096, 8192, transposed=False) == (128, 128, 2, 4, 3)
        monkeypatch.setenv("JSPEC_MATMUL", "fast")
        with pytest.raises(ValueError, match="JSPEC_MATMUL"):
            MV.pick_blocks(1, 8, 8, transposed=False)
    finally:
        MV._tuning_table.cache_clear()


def test_default_blocks_fill_the_card_within_shared_memory():
    for rows, K, N, t in [(1, 4096, 4096, False), (64, 4096, 128256, True), (16, 14336, 4096, False)]:
        b = MV.default_blocks(rows, K, N, transposed=t, sms=132)
        assert MV.smem_bytes(rows, b) <= MV.smem_limit()
        assert -(-N // b[0]) * b[2] >= 132 or K // (2 * b[2]) < 2 * b[1]


def test_unsplit_blocks_store_the_output_dtype():
    """Blocks that keep K whole store the rounded result (no summing kernel after); split blocks
    round the float32 sum once; both equal XLA's dot with a float32 accumulator."""
    x, w = _rand(7, (2, 64)).astype(jnp.bfloat16), _rand(8, (64, 48)).astype(jnp.bfloat16)
    ref = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    for blocks in (MV.Blocks(16, 64, 1, 4, 3), MV.Blocks(16, 16, 4, 4, 3)):
        got = MV.matvec(x, w, blocks=blocks, interpret=True)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=1e-2, atol=1e-2)


def _bench_shapes():
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_shapes.py")
    spec = importlib.util.spec_from_file_location("bench_shapes", path)
    B = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(B)
    return B


def test_wide_block_search_stays_small_and_in_budget():
    """bench_shapes --parts tune --wide: a staged search over BN 16-256, BK 64-512, splits, 2/4/8
    warps and 2-6 stages that times at most ~60 candidates a product (about a minute on a GPU),
    each within shared memory; it ends at the fastest (here: a made-up time model)."""
    B = _bench_shapes()
    fake = lambda b: abs(b[0] - 64) + abs(b[1] - 256) + 3 * abs(b[2] - 4) + abs(b[3] - 8) + abs(b[4] - 5)  # noqa: E731
    for cfg in (B.SHAPES["llama-3.2-1b"], B.SHAPES["llama-3.1-8b"]):
        for name, K, N, tr in B.layer_products(cfg):
            for m in (1, 64):
                results = B.wide_search(m, K, N, tr, fake, sms=132, log=lambda *a, **k: None)
                assert 10 <= len(results) <= 64, (name, m, len(results))
                assert all(MV.smem_bytes(m, b) <= MV.smem_limit() for b in results)
                assert {b[3] for b in results} == {2, 4, 8} and len({b[4] for b in results}) >= 3
                t, best, n = B.search_blocks(m, K, N, tr, fake, wide=True, log=lambda *a, **k: None)
                assert t == min(results.values()) and n == len(results)


def test_verify_part_times_each_size_per_kernel_variant(tmp_path, monkeypatch):
    """bench_shapes --parts verify --verify-sizes 16,24,tree24 --variants auto,portable: a row per
    size and variant, tree sizes as trees, the kernel choice restored after (where a tree's verify
    cost steps up, and whether the matvec or the attention kernel makes the step)."""
    from jspec.train.testing import tiny_target_config

    B = _bench_shapes()
    assert B.parse_verify_sizes("1,8,tree60") == [(1, False), (8, False), (60, True)]
    for bad in ("0", "65", "tree", "tree70", "x"):
        with pytest.raises(ValueError, match="--verify-sizes"):
            B.parse_verify_sizes(bad)
    monkeypatch.delenv("JSPEC_KERNELS", raising=False)
    monkeypatch.delenv("JSPEC_MATMUL", raising=False)
    cfg = tiny_target_config()
    params = B.M.init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    rows = B.Rows(tmp_path / "rows.json")
    B.verify_part("tiny", cfg, params, rows, n=2, sizes=[(1, False), (5, True)], variants=("auto", "portable"))
    got = [(r["variant"], r["T"], r["tree"]) for r in rows.rows]
    assert got == [("auto", 1, False), ("auto", 5, True), ("portable", 1, False), ("portable", 5, True)]
    assert all(r["ms_per_step"] > 0 for r in rows.rows)
    assert "JSPEC_KERNELS" not in os.environ and os.environ.get("JSPEC_MATMUL") == "auto"


@pytest.mark.parametrize("layout", ["kn", "nk", "stacked"])
def test_one_row_on_the_cuda_cores_matches_dot(layout):
    """fma blocks (a one-row product multiplied and summed without tensor-core tiles): the same
    product, tails and split K included; more rows ignore it."""
    K, N = 100, 70
    w = {"kn": _rand(1, (K, N)), "nk": _rand(1, (N, K)), "stacked": _rand(1, (2, K, N))}[layout]
    kw = {"kn": {}, "nk": dict(transposed=True), "stacked": dict(layer=jnp.int32(1))}[layout]
    wk = {"kn": w, "nk": w.T, "stacked": w[1] if layout == "stacked" else w}[layout]
    fma = MV.Blocks(32, 32, 3, 4, 3, fma=1)
    assert fma.fma and fma[:5] == (32, 32, 3, 4, 3) and not MV.Blocks(*fma[:5]).fma
    for rows in (1, 3):
        x = _rand(rows, (rows, K))
        np.testing.assert_allclose(MV.matvec(x, w, blocks=fma, interpret=True, **kw), x @ wk, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(MV.matvec(x, w, blocks=MV.Blocks(16, 128, 1, 4, 3, fma=1), interpret=True, **kw),
                                   x @ wk, rtol=2e-5, atol=2e-5)


H200_SMEM = 232448  # what Triton reported available on the H200 (227 KiB, sm_90)


@pytest.fixture
def untuned_card(monkeypatch, tmp_path):
    """A card with no tuning entries (the H200 had none at these row counts): the rule's blocks."""
    table = tmp_path / "empty.json"
    table.write_text("{}")
    monkeypatch.setenv("JSPEC_MATVEC_TUNING", str(table))
    monkeypatch.setenv("JSPEC_MATMUL", "auto")
    monkeypatch.setattr(MV, "card_name", lambda: "untuned")
    monkeypatch.setattr(MV, "smem_limit", lambda: H200_SMEM)
    monkeypatch.setattr(MV, "_sm_count", lambda: 132)  # the H200's (and the H100's)
    MV._tuning_table.cache_clear()
    yield
    MV._tuning_table.cache_clear()


@pytest.mark.parametrize("name,D,F,rows", [
    ("llama-3.2-1b decode, batch 16", 2048, 8192, 16),
    ("smollm2-135m prefill of a batch-1 run (64 prompt tokens)", 576, 1536, 64),
    ("smollm2-135m decode, batch 1", 576, 1536, 1)])
def test_untuned_mlp_blocks_fit_shared_memory(untuned_card, name, D, F, rows):
    """The MLP's products with the blocks the model picks on an untuned card (stacked weights read
    in place) are within the H200's 232,448 bytes as the rule chose them: fitting keeps them."""
    for K, N in ((D, 2 * F), (F, D)):
        blocks = MV.pick_blocks(rows, K, N, transposed=False, in_place=True)
        assert MV.smem_bytes(rows, blocks) <= H200_SMEM, (name, K, N, blocks)
        assert MV.fit_blocks(rows, blocks) == blocks


def test_fit_blocks_clamps_stages_then_block_k():
    b = MV.Blocks(64, 256, 4, 4, 4)
    plain = MV.smem_bytes(16, b)
    assert MV.fit_blocks(16, b, limit=plain) == b
    assert MV.fit_blocks(16, b, limit=plain - 1)[:5] == (64, 256, 4, 4, 3)
    one_stage = MV.smem_bytes(16, MV.Blocks(64, 256, 4, 4, 1))
    assert MV.fit_blocks(16, b, limit=one_stage) == (64, 256, 4, 4, 1)
    assert MV.fit_blocks(16, b, limit=one_stage - 1) == (64, 128, 4, 4, 1)
    fma = MV.Blocks(64, 256, 4, 4, 4, fma=1)
    assert MV.fit_blocks(1, fma, limit=MV.smem_bytes(1, fma) - 1).fma
    with pytest.raises(ValueError, match="shared memory"):
        MV.fit_blocks(64, b, limit=1024)
    # an x of a wider dtype than W's is converted before the product: it asks for more
    assert plain < MV.smem_bytes(16, b, x_itemsize=4)
    assert MV.fit_blocks(16, b, limit=plain, x_itemsize=4) == (64, 256, 4, 4, 3)


def test_tuned_blocks_are_fitted_and_tuning_proposes_none_over_the_limit(monkeypatch, tmp_path):
    """A table entry measured at fewer rows (or on a card with more shared memory) is fitted like
    the rule's blocks; bench_shapes --parts tune only proposes blocks within the limit."""
    table = tmp_path / "t.json"
    key = MV.tuning_key(64, 4096, 4096, False, jnp.bfloat16)
    table.write_text('{"cpu": {"%s": {"blocks": [128, 256, 2, 4, 4], "xla_faster": false}}}' % key)
    monkeypatch.setenv("JSPEC_MATVEC_TUNING", str(table))
    monkeypatch.setenv("JSPEC_MATMUL", "auto")
    monkeypatch.setattr(MV, "card_name", lambda: "cpu")
    monkeypatch.setattr(MV, "smem_limit", lambda: 99 * 1024)
    MV._tuning_table.cache_clear()
    try:
        got = MV.pick_blocks(64, 4096, 4096, transposed=False)
        assert got[:4] == (128, 256, 2, 4) and got[4] < 4 and MV.smem_bytes(64, got) <= 99 * 1024
        for rows, K, N, t in [(1, 4096, 4096, False), (64, 4096, 128256, True), (64, 576, 576, False)]:
            assert MV.smem_bytes(rows, MV.default_blocks(rows, K, N, transposed=t, sms=132)) <= 99 * 1024
            cands = MV.candidate_blocks(rows, K, N, transposed=t, sms=132)
            assert all(MV.smem_bytes(rows, b) <= 99 * 1024 for b in cands)
        assert MV.candidate_blocks(1, 4096, 4096, transposed=False, sms=132)
    finally:
        MV._tuning_table.cache_clear()


def test_shared_memory_limit_from_the_device(monkeypatch):
    class Gpu:
        platform = "gpu"

        def __init__(self, cc):
            if cc:
                self.compute_capability = cc

    for devices, limit in [([Gpu("9.0")], 227 * 1024), ([Gpu("8.9")], 99 * 1024), ([Gpu("8.0")], 163 * 1024),
                           ([Gpu(None)], 48 * 1024), ([Gpu("7.5")], 48 * 1024), (jax.devices("cpu"), 227 * 1024)]:
        monkeypatch.setattr(jax, "devices", lambda *a, d=devices: d)
        MV.smem_limit.cache_clear()
        assert MV.smem_limit() == limit
    MV.smem_limit.cache_clear()


@pytest.mark.parametrize("layout", ["kn", "stacked"])
def test_fitted_blocks_compute_the_portable_product(monkeypatch, layout):
    """Blocks over a (made-up small) limit run fitted, in interpret mode: fewer stages, then a
    smaller BK (more K tiles); the result is still the portable one."""
    rows, K, N = 3, 96, 40
    x = _rand(11, (rows, K))
    w = 0.2 * (_rand(13, (2, K, N)) if layout == "stacked" else _rand(13, (K, N)))
    kw = dict(layer=jnp.int32(1)) if layout == "stacked" else {}
    ref = x @ (w[1] if layout == "stacked" else w)
    blocks = MV.Blocks(16, 64, 1, 4, 4)
    limit = MV.smem_bytes(rows, MV.Blocks(16, 32, 1, 4, 1), 4)  # 1 stage and BK 32 fit, BK 64 does not
    fitted = []
    fit = MV.fit_blocks
    monkeypatch.setattr(MV, "smem_limit", lambda: limit)
    monkeypatch.setattr(MV, "fit_blocks", lambda *a, **k: fitted.append(fit(*a, **k)) or fitted[-1])
    got = MV.matvec(x, w, blocks=blocks, interpret=True, **kw)
    assert fitted == [(16, 32, 1, 4, 1)]
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


def test_shipped_tuning_fits_its_cards_unchanged():
    """Every entry of the shipped table (H100 / H200: 227 KiB) is within the limit, so the kernel
    runs the measured blocks as they were."""
    import json
    table = json.loads(MV.TUNING_FILE.read_text())
    assert table
    for card, entries in table.items():
        for key, entry in entries.items():
            shape, dtype = key.split(":")
            rows, K, N = shape.rstrip("t").split("x")
            blocks = MV.Blocks(*entry["blocks"])
            itemsize = jnp.dtype(dtype).itemsize
            assert MV.smem_bytes(int(rows), blocks, itemsize) <= H200_SMEM, (card, key)
            assert MV.fit_blocks(int(rows), blocks, itemsize, limit=H200_SMEM) == blocks


def test_untuned_row_counts_take_the_next_larger_tuned_entry():
    key = lambda rows, N: MV.tuning_key(rows, 4096, N, False, jnp.bfloat16)  # noqa: E731
    table = {key(1, 4096): {"blocks": [64, 128, 4, 4, 4]}, key(64, 4096): {"blocks": [128, 128, 2, 4, 4]},
             key(32, 8192): {"blocks": [64, 256, 1, 4, 3]}, key(64, 8192): {"blocks": [128, 128, 1, 4, 4]}}
    entry = lambda M, N: MV.tuned_entry(table, M, 4096, N, False, jnp.bfloat16)  # noqa: E731
    assert entry(1, 4096)["blocks"] == [64, 128, 4, 4, 4]  # its own bucket
    assert entry(8, 4096)["blocks"] == entry(16, 4096)["blocks"] == [128, 128, 2, 4, 4]  # 16-row bucket: the 64's
    assert entry(8, 8192)["blocks"] == [64, 256, 1, 4, 3]  # the nearest larger one
    assert entry(64, 8192)["blocks"] == [128, 128, 1, 4, 4]
    assert entry(1, 8192) is None  # one row never borrows a multi-row tile's blocks
    assert entry(8, 2048) is None
