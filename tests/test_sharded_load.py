"""Sharded Hugging Face checkpoints with Llama-3.1's config and tensor names, streamed by load_hf.

The files are written by safetensors itself (synthetic.write_sharded_target), at a scaled-down
Llama-3.1 shape with its real names, several shards and an index; the reference is the state-dict
path (layout.build_params over every tensor read back by safetensors), which shares no reading or
placement code with the streaming loader.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jspec.checkpoint import CheckpointNotFoundError, MissingTensorError
from jspec.checkpoint import hf as HF
from jspec.checkpoint.hf import load_hf, params_from_hf_state_dict
from jspec.checkpoint.synthetic import llama31_8b_target, write_sharded_target
from jspec.sharding import make_mesh, param_shardings

# Llama-3.1-8B's config (llama3 rope scaling, GQA 4:1, untied head, its token ids) at a small size
CFG = llama31_8b_target().replace(vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=4,
                                  num_heads=8, num_kv_heads=2, head_dim=8, bos_token_id=1, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama31")
    write_sharded_target(str(path), CFG, dtype="bfloat16", max_shard_bytes=60_000)
    return path


def reference(path, dtype):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    sd = {}
    for shard in sorted(set(index["weight_map"].values())):
        sd.update({k: v.astype(np.float32) for k, v in load_file(str(path / shard)).items()})
    return params_from_hf_state_dict(CFG, sd, dtype)


def assert_trees_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), err_msg=str(path))


def test_sharded_llama31_checkpoint_loads_like_the_reference(checkpoint):
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    wm = index["weight_map"]
    assert wm["model.embed_tokens.weight"] == shards[0] and wm["lm_head.weight"] == shards[-1]
    assert wm["model.layers.0.self_attn.q_proj.weight"] != wm["model.layers.3.self_attn.q_proj.weight"]
    for dtype in (jnp.bfloat16, jnp.float32):  # as stored, and widened on the way
        cfg, params = load_hf(checkpoint, dtype)
        assert cfg == CFG
        assert_trees_equal(params, reference(checkpoint, dtype))
        # default placement, as jnp.asarray gives: a later jit or device_put may move the weights
        assert not any(x.committed for x in jax.tree.leaves(params))


def test_sharded_checkpoint_loads_into_an_8_device_mesh(checkpoint):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake) devices")
    mesh = make_mesh(data=2, model=4)
    _, params = load_hf(checkpoint, jnp.bfloat16, mesh=mesh)
    want = reference(checkpoint, jnp.bfloat16)
    assert_trees_equal(params, want)
    shardings = param_shardings(want, mesh)
    for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(shardings)):
        assert x.sharding.is_equivalent_to(s, x.ndim), path
    for leaf in ("wqkv", "w_gate_up", "w_down"):  # split over the model axis, not replicated
        x = params["layers"][leaf]
        assert "model" in tuple(x.sharding.spec), leaf
        shard = x.sharding.shard_shape(x.shape)
        assert np.prod(shard) * 4 == x.size and {s.data.shape for s in x.addressable_shards} == {shard}
        assert len(x.addressable_shards) == 8
    _, on_one = load_hf(checkpoint, jnp.bfloat16, device=jax.devices()[5])
    assert {x.sharding for x in jax.tree.leaves(on_one)} == {jax.sharding.SingleDeviceSharding(jax.devices()[5])}
    assert_trees_equal(on_one, want)


def test_missing_shard_or_tensor_is_one_line_before_any_weight_is_read(checkpoint, tmp_path, monkeypatch):
    def no_reading(*a, **k):
        raise AssertionError("weights were read before the checkpoint was checked")

    monkeypatch.setattr(HF, "place_params", no_reading)
    for f in checkpoint.iterdir():
        os.symlink(f, tmp_path / f.name)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / last).unlink()
    with pytest.raises(CheckpointNotFoundError) as e:
        load_hf(tmp_path)
    assert last in str(e.value) and "missing" in str(e.value) and "\n" not in str(e.value)

    os.symlink(checkpoint / last, tmp_path / last)
    (tmp_path / "model.safetensors.index.json").unlink()
    del index["weight_map"]["model.layers.2.mlp.up_proj.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MissingTensorError, match=r"'model\.layers\.2\.mlp\.up_proj\.weight' is missing") as e:
        load_hf(tmp_path)
    assert "\n" not in str(e.value)


def test_float32_files_round_to_bfloat16_as_the_reference(tmp_path):
    """Narrowing on the host (ml_dtypes) rounds as the reference's XLA convert does."""
    cfg = CFG.replace(num_layers=1)
    write_sharded_target(str(tmp_path), cfg, dtype="float32", max_shard_bytes=100_000)
    sd = {}
    for f in tmp_path.glob("*.safetensors"):
        sd.update(load_file(str(f)))
    _, got = load_hf(tmp_path, jnp.bfloat16)
    assert_trees_equal(got, params_from_hf_state_dict(cfg, sd, jnp.bfloat16))
