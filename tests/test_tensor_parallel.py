"""Tensor parallelism (generate(mesh="model=N")) on 8 fake CPU devices: the per-head layout
round-trips and gives each device [q_i | k_i | v_i] and [gate_i | up_i]; the shard_map forward
(psum after wo and w_down, vocab-split LM head, KV cache split on kv heads) gives one device's
float32 logits and greedy tokens, GQA included, on model=2, model=4 and data=2,model=2; an EAGLE-3
chain and an EAGLE-1 tree run under the same mesh; a second generation on the same weights reuses
their placed layout; a model=N that does not divide the kv heads is a one-line error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jspec import model as M
from jspec.config import ModelConfig
from jspec.generate import SpeculativeConfig, generate
from jspec.kernels import matvec as MV
from jspec.sharding import (parse_mesh, place_tensor_parallel, tensor_parallel_config, tensor_parallel_layout,
                            tensor_parallel_map, tensor_parallel_specs)
from jspec.speculative.engines.tree import TreeConfig
from spec_tiny import CFG as SPEC_CFG, _drafters

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")

# GQA 8/4 (two q heads per kv head), untied LM head (split over the vocabulary), q/k/v bias
CFG = ModelConfig(arch="qwen2", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=8,
                  num_kv_heads=4, head_dim=8, attention_bias=True, max_position_embeddings=256)
# the fused attention kernel needs head_dim >= 32: GQA 4/2, one kv head per device at model=2
KERNEL_CFG = ModelConfig(arch="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=256)
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11, 12, 13], [20]]


@pytest.fixture(scope="module")
def target():
    params = M.init_params(CFG, jax.random.PRNGKey(0), scale=0.35)
    params["layers"]["bqkv"] = 0.3 * jax.random.normal(jax.random.PRNGKey(1), params["layers"]["bqkv"].shape)
    return params


def test_layout_round_trips_and_gives_each_device_its_heads(target):
    n, hd, F = 2, CFG.head_dim, CFG.intermediate_size
    laid = tensor_parallel_layout(target, CFG, n)
    back = tensor_parallel_layout(laid, CFG, n, inverse=True)
    jax.tree.map(np.testing.assert_array_equal, back, target)
    w, wl = np.asarray(target["layers"]["wqkv"]), np.asarray(laid["layers"]["wqkv"])
    q, kv = CFG.q_size, CFG.kv_size
    for i, shard in enumerate(np.split(wl, n, axis=-1)):  # device i: q heads 4i..4i+3, kv heads 2i, 2i+1
        want = np.concatenate([w[..., i * q // n:(i + 1) * q // n], w[..., q + i * kv // n:q + (i + 1) * kv // n],
                               w[..., q + kv + i * kv // n:q + kv + (i + 1) * kv // n]], -1)
        np.testing.assert_array_equal(shard, want)
        assert shard.shape[-1] == (4 + 2 + 2) * hd
    g, gl = np.asarray(target["layers"]["w_gate_up"]), np.asarray(laid["layers"]["w_gate_up"])
    for i, shard in enumerate(np.split(gl, n, axis=-1)):
        f = F // n
        np.testing.assert_array_equal(shard, np.concatenate([g[..., i * f:(i + 1) * f], g[..., F + i * f:F + (i + 1) * f]], -1))
    # weights committed to a device outside the mesh (a loaded checkpoint) are moved shard by shard
    placed = place_tensor_parallel(jax.device_put(target, jax.devices()[5]), CFG, parse_mesh("model=2"))
    assert placed["layers"]["wqkv"].sharding.spec == P(None, None, "model")
    assert placed["layers"]["wo"].sharding.spec == P(None, "model", None)
    assert placed["lm_head"].sharding.spec == P(None, "model") and placed["embed"].sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(placed["layers"]["wqkv"]), wl)


def _logits_and_cache(params, cfg, tokens, kernels=None):
    """A prompt forward and two one-token decode steps; their logits and the cache's K."""
    cache = M.init_cache(cfg, tokens.shape[0], 32)
    out = M.forward(params, cfg, tokens, cache, kernels=kernels)
    cache = M.advance(out.cache, jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32))
    logits = [M.lm_head(params, cfg, out.hidden, kernels=kernels)]
    for t in range(2):
        step = M.forward(params, cfg, tokens[:, t:t + 1], cache, kernels=kernels)
        cache = M.advance(step.cache, jnp.ones_like(cache.lengths))
        logits.append(M.lm_head(params, cfg, step.hidden, kernels=kernels))
    return jnp.concatenate(logits, 1), cache.k


@pytest.mark.parametrize("n,kernels", [(2, "xla"), (4, "xla"), (2, "pallas")])
def test_tensor_parallel_logits_equal_one_device(target, n, kernels):
    # "pallas": each device runs the fused attention kernel and the matvec kernel (interpret mode
    # here) on its own q and kv heads and its slice of the MLP
    cfg = KERNEL_CFG if kernels == "pallas" else CFG
    params = target if kernels != "pallas" else M.init_params(cfg, jax.random.PRNGKey(2), scale=0.2)
    tokens = jnp.asarray([[5, 6, 7, 8], [9, 10, 11, 12]], jnp.int32)
    ref_logits, ref_k = _logits_and_cache(params, cfg, tokens, kernels="xla")
    mesh = parse_mesh(f"model={n}")
    specs = tensor_parallel_specs(params, cfg, n)
    local = tensor_parallel_config(cfg, n)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (
        cfg.num_heads // n, cfg.num_kv_heads // n, cfg.intermediate_size // n)
    if kernels == "pallas":  # the per-device shapes are ones the kernels take
        assert M.fused_attention_supported(local, 1, None)
        assert MV.pick_blocks(2, local.hidden_size, local.q_size + 2 * local.kv_size, transposed=False,
                              dtype=jnp.float32, in_place=True) is not None

    def run(params, tokens):
        logits, k = _logits_and_cache(params, local, tokens, kernels=kernels)
        return logits, jax.lax.all_gather(k, "model", axis=3, tiled=True)  # the per-device caches, side by side

    fn = tensor_parallel_map(run, mesh, "params", specs, ())
    logits, k = fn(place_tensor_parallel(params, cfg, mesh), {"tokens": tokens})
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(k), np.asarray(ref_k), rtol=1e-5, atol=1e-5)  # kv heads in order
    np.testing.assert_array_equal(np.argmax(logits, -1), np.argmax(ref_logits, -1))


def test_tensor_parallel_generate_equals_one_device(target):
    ref = generate(target, CFG, PROMPTS, max_new_tokens=10)
    for mesh in ("model=2", "model=4", "data=2,model=2"):
        out = generate(target, CFG, PROMPTS, max_new_tokens=10, mesh=mesh)
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        np.testing.assert_array_equal(out.lengths, ref.lengths)


def test_second_generate_reuses_the_placed_layout(target, monkeypatch):
    """The per-head layout moves and permutes every weight: generate lays the same weights out once
    per mesh, and again only for other weights or another mesh."""
    from jspec import sharding
    calls = []
    laid_out = sharding._laid_out
    monkeypatch.setattr(sharding, "_laid_out", lambda *a, **k: calls.append(a[0]) or laid_out(*a, **k))
    first = generate(target, CFG, PROMPTS, max_new_tokens=3, mesh="model=2")
    assert calls
    n = len(calls)
    again = generate(target, CFG, PROMPTS, max_new_tokens=3, mesh="model=2")
    assert len(calls) == n  # not laid out again
    np.testing.assert_array_equal(again.tokens, first.tokens)
    other = {**target, "final_norm": target["final_norm"] * 2}
    generate(other, CFG, PROMPTS, max_new_tokens=3, mesh="model=2")
    assert len(calls) == 2 * n  # other weights: placed anew


def test_eagle3_chain_under_model_2_and_data_2_model_2_equals_one_device():
    target = M.init_params(SPEC_CFG, jax.random.PRNGKey(0), scale=0.35)
    drafter, dparams = _drafters(target)["eagle3"]
    spec = SpeculativeConfig(drafter=drafter, drafter_params=dparams, policy="static", k_max=3)
    ref = generate(target, SPEC_CFG, PROMPTS, max_new_tokens=12, speculative=spec)
    for mesh in ("model=2", "data=2,model=2"):  # data=2: 3 rows padded to 4, two model groups
        out = generate(target, SPEC_CFG, PROMPTS, max_new_tokens=12, speculative=spec, mesh=mesh)
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        np.testing.assert_array_equal(out.accepted, ref.accepted)
    assert out.accepted.sum() > 0 and out.tokens.shape[0] == len(PROMPTS)


def test_eagle1_tree_under_model_2_equals_one_device():
    # EAGLE-1 drafts through the target's LM head: under model=2 each device holds half the
    # vocabulary's columns and the head's logits are gathered
    target = M.init_params(SPEC_CFG, jax.random.PRNGKey(0), scale=0.35)
    drafter, dparams = _drafters(target)["eagle"]
    spec = SpeculativeConfig(drafter=drafter, drafter_params=dparams, tree=TreeConfig(top_k=3, depth=3, num_nodes=8))
    ref = generate(target, SPEC_CFG, PROMPTS, max_new_tokens=12, speculative=spec)
    out = generate(target, SPEC_CFG, PROMPTS, max_new_tokens=12, speculative=spec, mesh="model=2")
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.accepted, ref.accepted)


def test_model_axis_that_does_not_split_the_kv_heads_is_a_one_line_error(target):
    with pytest.raises(ValueError, match=r"^model=8 must divide num_kv_heads=4.*N dividing 4$") as e:
        generate(target, CFG, PROMPTS, max_new_tokens=4, mesh="model=8")
    assert "\n" not in str(e.value)
