"""Greedy speculative decoding reproduces an independent reference: a transformers greedy loop.

The reference owes nothing to jspec: a 1-layer transformers Llama decoded with a plain argmax loop
(a full forward per token, no cache). jspec loads the same weights through its Hugging Face
loader, and its AR decoding, EAGLE chains and EAGLE-2 trees under every draft-length policy must
emit exactly the reference's tokens for a ragged batch of prompts, EOS stops included. (A bug
shared by jspec's AR loop and its speculative engines, e.g. in cached attention, would pass a
comparison with jspec's own AR; it does not pass this one.)

The drafts are accepted often, so deep tree paths, bonus tokens and the K/V moves after every
round all run: the EAGLE-1 head is the target's own layer, lightly perturbed
(`test_lossless_sampling.eagle_copy_head`; the target's embeddings are unit-RMS and its input
norm is 1, because that head has no input norm). The greedy argmax does not care about the final
norm's scale, so this head agrees with the target on most tokens.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from jspec.checkpoint.hf import params_from_hf_state_dict
from jspec.config import config_from_hf
from jspec.generate import SpeculativeConfig, generate
from jspec.speculative.drafters.eagle import EagleDrafter
from jspec.speculative.engines.tree import TreeConfig
from jspec.speculative.policies import POLICY_NAMES, make_policy
from jspec.speculative.policies.ldlp import init_ldlp
from test_lossless_sampling import eagle_copy_head, noised

V = 24
PROMPTS = [[5, 9, 2, 7, 11, 3, 14, 6, 19, 10, 4, 12], [8, 17, 3], [20, 6, 6, 13, 9, 21, 15]]
MAX_NEW = 16
K = 4  # chain draft length
TREE = TreeConfig(top_k=2, depth=3, num_nodes=6)  # small: one compile per policy


def hf_target(eos: int | None):
    """A random 1-layer transformers Llama: unit-RMS embeddings, input and final norms of 1, a
    random post-attention norm."""
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=eos, pad_token_id=0, tie_word_embeddings=False,
    )
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "post_attention_layernorm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif "norm" in name:
                p.fill_(1.0)
            elif "embed_tokens" in name:
                p.copy_(noise / noise.pow(2).mean(-1, keepdim=True).sqrt())
            elif "lm_head" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.15 * noise)
    return model.eval()


def hf_greedy(model, prompt, eos):
    """(tokens, smallest top-1 minus top-2 logit gap): argmax decoding, one full forward per token."""
    seq, out, gap = list(prompt), [], np.inf
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logits = model(torch.tensor([seq])).logits[0, -1]
            top = torch.topk(logits, 2).values
            gap = min(gap, float(top[0] - top[1]))
            out.append(int(logits.argmax()))
            seq.append(out[-1])
            if out[-1] == eos:
                break
    return out, gap


@pytest.fixture(scope="module")
def setup():
    """(cfg, params, reference rows). EOS is the token whose first appearance in prompt 0's
    reference (decoded without EOS) comes last, so that row stops late and others may not stop."""
    free = hf_greedy(hf_target(None), PROMPTS[0], None)[0]
    eos = max(set(free), key=free.index)
    model = hf_target(eos)
    cfg = config_from_hf(model.config.to_dict())
    assert cfg.eos_token_ids == (eos,)
    params = params_from_hf_state_dict(cfg, {k: v.detach().numpy() for k, v in model.state_dict().items()})
    refs = [hf_greedy(model, p, eos) for p in PROMPTS]
    assert min(gap for _, gap in refs) > 1e-3  # no near-ties: fp32 rounding cannot flip an argmax
    rows = [r for r, _ in refs]
    assert any(len(r) < MAX_NEW for r in rows) and any(len(r) == MAX_NEW for r in rows)
    return cfg, params, rows


def _eagle(cfg, params):
    hc, hp = eagle_copy_head(params, cfg)
    return EagleDrafter(hc), noised(hp, jax.random.PRNGKey(3), 0.1)


def _assert_rows(res, rows, what):
    for b, ref in enumerate(rows):
        assert res.row(b) == ref, f"{what}: row {b} differs from transformers' greedy decoding"


def test_ar_matches_transformers(setup):
    cfg, params, rows = setup
    _assert_rows(generate(params, cfg, PROMPTS, max_new_tokens=MAX_NEW), rows, "AR")


def test_eagle_chain_matches_transformers(setup):
    # Other drafters and policies on chains: test_spec.py, test_spec_heads.py, against jspec's AR (= this reference).
    cfg, params, rows = setup
    drafter, dparams = _eagle(cfg, params)
    res = generate(params, cfg, PROMPTS, max_new_tokens=MAX_NEW,
                   speculative=SpeculativeConfig(drafter=drafter, drafter_params=dparams, k_max=K))
    _assert_rows(res, rows, "eagle chain")
    assert (res.step_tokens == K + 1).any()  # some round accepted every draft: bonus tokens ran


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
def test_tree_matches_transformers(setup, policy_name):
    cfg, params, rows = setup
    drafter, dparams = _eagle(cfg, params)
    pp = None
    if policy_name == "ldlp":  # a random predictor, biased to predict lengths around the depth
        pp = {**init_ldlp(cfg.hidden_size, jax.random.PRNGKey(5), hidden=16), "b_out": np.float32(TREE.depth - 1)}
    res = generate(params, cfg, PROMPTS, max_new_tokens=MAX_NEW,
                   speculative=SpeculativeConfig(drafter=drafter, drafter_params=dparams, tree=TREE, policy=make_policy(policy_name, k_max=TREE.depth), policy_params=pp))
    _assert_rows(res, rows, f"tree/{policy_name}")
    assert (res.step_tokens >= 3).any()  # paths of depth >= 2 were accepted
