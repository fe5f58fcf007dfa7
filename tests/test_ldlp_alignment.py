"""LDLP trains and infers on one alignment: (e, f) = (embed[x_{t+1}], f_t) at a round that starts
after the target read x_0..x_t, and the label at t is what greedy verification accepts from a
k_max-token chain started there.

Checked against the chain engine through its public traces, in one run with an LDLP policy of
fixed random weights: every round's draft length equals the predictor applied to the
training-side pair at that round's position, and every round's accepted count equals
min(training label, drafted length)."""

import jax
import jax.numpy as jnp
import numpy as np

from jspec.generate import SpeculativeConfig, generate
from jspec.heads import eagle as H
from jspec.model import forward, init_cache, init_params
from jspec.speculative.drafters.eagle import EagleDrafter
from jspec.speculative.policies.ldlp import LDLPPolicy, init_ldlp, ldlp_apply, length_from_prediction
from jspec.train import ldlp as TL
from jspec.train.testing import numpy_params, tiny_target_config

TARGET = tiny_target_config(eos_token_ids=())  # no EOS: every round drafts its full length
K, MAX_NEW = 4, 24
PROMPTS = [[5, 9, 17, 33, 2], [7, 7, 40, 3, 11, 60, 21]]


def _setup():
    """A tiny target whose layers are weak, so its greedy answer mostly repeats a token with
    occasional switches, and an EAGLE-3 head (fc averaging the captured inputs, LM head = the
    target's embedding, weak random layer) that drafts "the current token again": acceptance is
    partial (0..K) instead of always 0, while every path of the head still runs."""
    tparams = numpy_params(init_params, TARGET, seed=0, scale=0.3)
    weak = numpy_params(init_params, TARGET, seed=5, scale=0.05)["layers"]
    tparams["layers"] = {k: v if "norm" in k else weak[k] for k, v in tparams["layers"].items()}
    hcfg = H.default_head_config("eagle3", TARGET)
    head = numpy_params(H.init_head, hcfg, seed=1, scale=0.02)
    D = TARGET.hidden_size
    head["fc"] = jnp.concatenate([jnp.eye(D)] * 3, 0) / 3.0
    head["lm_head"] = tparams["embed"].T
    return tparams, hcfg, head


def _sequences(tparams):
    """Prompt + greedy answer per row (speculative greedy decoding gives the same tokens), padded."""
    ar = generate(tparams, TARGET, PROMPTS, max_new_tokens=MAX_NEW)
    seqs = [p + ar.row(b) for b, p in enumerate(PROMPTS)]
    T = max(map(len, seqs)) + K + 2
    tokens = np.zeros((len(seqs), T), np.int32)
    mask = np.zeros((len(seqs), T), bool)
    for b, s in enumerate(seqs):
        tokens[b, : len(s)] = s
        mask[b, len(PROMPTS[b]) : len(s)] = True
    return tokens, mask


def _round_starts(res, b):
    """Position t of each speculative round (call c >= 1) of row b: the target has read x_0..x_t."""
    P = len(PROMPTS[b])
    emitted = np.cumsum(res.step_tokens[b])
    return [(c, P + int(emitted[c - 1]) - 2) for c in range(1, int(res.target_calls[b]))]


def test_engine_rounds_match_ldlp_pairs_and_labels():
    tparams, hcfg, head = _setup()
    ldlp = init_ldlp(TARGET.hidden_size, jax.random.PRNGKey(3), hidden=16)
    ldlp["w_out"] = ldlp["w_out"] * -10.0  # spread the predictions over 1..K (long ones inside repeats)
    ldlp["b_out"] = jnp.float32(3.0)
    res = generate(tparams, TARGET, PROMPTS, max_new_tokens=MAX_NEW,
                   speculative=SpeculativeConfig(drafter=EagleDrafter(hcfg), drafter_params=head, policy=LDLPPolicy(k_max=K), policy_params=ldlp, k_max=K))
    tokens, mask = _sequences(tparams)
    out = forward(tparams, TARGET, jnp.asarray(tokens), init_cache(TARGET, *tokens.shape, jnp.float32))
    e, f = TL.round_pairs(tparams, jnp.asarray(tokens), out.hidden)
    expected = np.asarray(length_from_prediction(ldlp_apply(ldlp, e, f), K))
    _, _, label, valid = TL.label_positions(hcfg, head, tparams, jnp.asarray(tokens), jnp.asarray(mask), k_max=K,
                                            logits_chunk=8)
    label, valid = np.asarray(label), np.asarray(valid)
    lengths, accepted = set(), set()
    for b in range(len(PROMPTS)):
        for c, t in _round_starts(res, b):
            if t + K + 2 >= len(PROMPTS[b]) + MAX_NEW:  # rounds cut by max_new draft and accept less
                continue
            assert valid[b, t]
            drafted = int(res.draft_lengths[b, c])
            assert drafted == expected[b, t], (b, c, t)  # LDLP read the same (e, f) as training builds
            assert res.step_tokens[b, c] - 1 == min(label[b, t], drafted), (b, c, t)  # label = acceptance
            lengths.add(drafted)
            accepted.add(int(res.step_tokens[b, c] - 1))
    assert len(lengths) >= 2 and len(accepted) >= 3 and 0 in accepted, (lengths, accepted)
