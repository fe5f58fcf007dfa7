import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.errors import UsageError

from jspec.speculative.policies.ldlp import (
    asymmetric_l1,
    init_ldlp,
    label_from_drafts,
    ldlp_apply,
    train_ldlp,
)


def test_apply_shapes_and_dtypes():
    params = init_ldlp(8, jax.random.key(0), hidden=16)
    assert params["w_in"].shape == (16, 16) and params["w_res"].shape == (3, 16, 16)
    emb = jnp.ones((3, 8), jnp.bfloat16)
    feat = jnp.ones((3, 8), jnp.bfloat16)
    out = ldlp_apply(params, emb, feat)
    assert out.shape == (3,) and out.dtype == jnp.float32
    assert ldlp_apply(params, jnp.ones((2, 3, 8)), jnp.ones((2, 3, 8))).shape == (2, 3)


def test_asymmetric_l1_weights_under_prediction():
    pred = jnp.array([1.0, 4.0])
    label = jnp.array([3, 3])
    # Under by 2 costs 3 * 2 = 6; over by 1 costs 1.
    assert float(asymmetric_l1(pred, label)) == pytest.approx(3.5)
    assert float(asymmetric_l1(pred, label, under_weight=1.0)) == pytest.approx(1.5)


def test_label_is_longest_common_prefix():
    drafts = jnp.array([[1, 2, 3, 4], [1, 9, 3, 4], [7, 2, 3, 4], [1, 2, 3, 5]])
    target = jnp.array([1, 2, 3, 5])
    np.testing.assert_array_equal(label_from_drafts(drafts, target), [3, 1, 0, 4])
    # Only the shorter length is compared.
    assert int(label_from_drafts(jnp.array([1, 2]), jnp.array([1, 2, 3]))) == 2


def _rms_normalize(x):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True))


def _synthetic(key, n, d):
    """Unit-RMS inputs (like final-normed target features) and a length that depends on both."""
    k_emb, k_feat = jax.random.split(key)
    emb = _rms_normalize(jax.random.normal(k_emb, (n, d)))
    feat = _rms_normalize(jax.random.normal(k_feat, (n, d)))
    labels = jnp.clip(jnp.round(3 + 2 * feat[:, 0] - 1.5 * emb[:, 1]), 0, 8)
    return emb, feat, labels


def test_training_learns_synthetic_rule():
    emb, feat, labels = _synthetic(jax.random.key(1), 1024, 8)
    params = train_ldlp(emb, feat, labels, steps=300, lr=1e-2, key=jax.random.key(2), hidden=32)
    # Judge on held-out rows against the best constant predictor (the 0.75 quantile for lambda=3).
    emb2, feat2, labels2 = _synthetic(jax.random.key(3), 1024, 8)
    pred = ldlp_apply(params, emb2, feat2)
    best_constant = asymmetric_l1(jnp.full(pred.shape, jnp.quantile(labels, 0.75)), labels2)
    assert float(asymmetric_l1(pred, labels2)) < 0.25 * float(best_constant)
    lengths = np.round(np.asarray(pred))
    assert np.mean(np.abs(lengths - np.asarray(labels2)) <= 1) > 0.95
    assert np.mean(lengths == np.asarray(labels2)) > 0.6


def test_train_ldlp_rejects_a_dataset_without_greedy_rows_before_loading_the_target(tmp_path, monkeypatch):
    """An all-sampled distillation (--sample-share 1.0) has no greedy answers to label: one line
    naming the problem, raised before the target is resolved."""
    import jspec.train.ldlp as T
    from jspec.train.testing import write_patterned_shards

    data = write_patterned_shards(str(tmp_path / "sampled"), 64, rows=16, temperature=0.7)
    head = tmp_path / "head"
    head.mkdir()

    def no_model(*a, **k):
        raise AssertionError("the target was loaded before the data were checked")

    monkeypatch.setattr(T, "resolve_model", no_model)
    args = T.add_ldlp_args(__import__("argparse").ArgumentParser()).parse_args(
        ["--target", "smollm2-135m-instruct", "--head", str(head), "--data", data])
    with pytest.raises(ValueError, match="no greedy rows"):
        T.run_train_ldlp(args)
    greedy = write_patterned_shards(str(tmp_path / "greedy"), 64)
    assert T.label_split(greedy) == "holdout"
    for head_dir, data_dir, problem in ((tmp_path / "none", greedy, "no head directory"),
                                        (head, tmp_path / "none", "no distilled dataset")):
        args = T.add_ldlp_args(__import__("argparse").ArgumentParser()).parse_args(
            ["--target", "smollm2-135m-instruct", "--head", str(head_dir), "--data", str(data_dir)])
        with pytest.raises(UsageError, match=problem):
            T.run_train_ldlp(args)
