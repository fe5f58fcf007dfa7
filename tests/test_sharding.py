"""Sharded execution on 8 fake CPU devices gives the same results as one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import model as M
from jspec.config import ModelConfig
from jspec.generate import generate
from jspec.sampling import Sampling
from jspec.sharding import make_mesh, param_shardings, shard_params, spec_for, verify_shardings
from jspec.speculative.verify.block import verify_block
from jspec.speculative.verify.chain import verify_greedy, verify_sampling

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")

CFG = ModelConfig(
    arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, eos_token_ids=(3,), max_position_embeddings=256,
)


def test_rules_replicate_what_does_not_divide():
    mesh = make_mesh(data=2, model=4)
    assert spec_for((6, 64), ("batch", "vocab"), mesh) == jax.sharding.PartitionSpec("data", "model")
    assert spec_for((3, 10), ("batch", "vocab"), mesh) == jax.sharding.PartitionSpec(None, None)


def test_sharded_generate_equals_single_device():
    params = M.init_params(CFG, jax.random.PRNGKey(0), scale=0.3)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20], [30, 31]]
    ref = generate(params, CFG, prompts, max_new_tokens=8)
    mesh = make_mesh(data=2, model=4)
    sharded = shard_params(params, mesh)
    assert sharded["embed"].sharding.spec == jax.sharding.PartitionSpec("model", None)
    assert param_shardings(params, mesh)["layers"]["wqkv"].spec == jax.sharding.PartitionSpec(None, None, "model")
    out = generate(sharded, CFG, prompts, max_new_tokens=8)  # GSPMD follows the input shardings
    np.testing.assert_array_equal(out.tokens, ref.tokens)


def test_sharded_acceptance_equals_single_device():
    B, K, V = 8, 4, 64
    key = jax.random.PRNGKey(1)
    logits = jax.random.normal(key, (B, K + 1, V)) * 3
    draft = jnp.argmax(logits[:, :K], -1).at[::3, 2].set(7)  # some rows reject mid-way
    valid = jnp.ones((B, K), bool).at[1, 3].set(False)
    q = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(2), (B, K, V)), -1)
    sampling = Sampling(temperature=0.9, top_p=0.95)

    ref_g = verify_greedy(logits, draft, valid)
    ref_s = verify_sampling(key, logits, draft, valid, sampling, q)
    ref_b = verify_block(key, logits, draft, valid, sampling, q)

    mesh = make_mesh(data=2, model=4)
    ls, rs = verify_shardings(mesh, B, K, V)
    qs = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None, "model"))
    lg, dr, va, qq = (jax.device_put(logits, ls), jax.device_put(draft, rs), jax.device_put(valid, rs), jax.device_put(q, qs))
    got_g = jax.jit(verify_greedy)(lg, dr, va)
    got_s = jax.jit(verify_sampling, static_argnums=4)(key, lg, dr, va, sampling, qq)
    got_b = jax.jit(verify_block, static_argnums=4)(key, lg, dr, va, sampling, qq)
    for a, b in zip(ref_g + ref_s + ref_b, got_g + got_s + got_b):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
