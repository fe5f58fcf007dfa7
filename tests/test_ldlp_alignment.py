"""LDLP trains and infers on one alignment: (e, f) = (embed[x_{t+1}], f_t) at a round that starts
after the target read x_0..x_t, and the label at t is what greedy verification accepts from a
k_max-token chain started there.

Both are checked against the chain engine through its public traces: with an LDLP policy of fixed
random weights, the draft length of every round equals the predictor applied to the training-side
pair at that round's position; with static K, every round's accepted count equals the training
label at its position."""

import jax
import jax.numpy as jnp
import numpy as np

from jspec.generate import generate
from jspec.heads import eagle as H
from jspec.model import init_params
from jspec.speculative.drafters.eagle import EagleDrafter
from jspec.speculative.policies.ldlp import LDLPPolicy, init_ldlp, ldlp_apply, length_from_prediction
from jspec.train import ldlp as TL
from jspec.train.testing import numpy_params, tiny_target_config

TARGET = tiny_target_config(eos_token_ids=())  # no EOS: every round drafts its full length
K, MAX_NEW = 4, 24
PROMPTS = [[5, 9, 17, 33, 2], [7, 7, 40, 3, 11, 60, 21]]


def _setup(copying: bool = False):
    """A random tiny target and EAGLE-3 head. copying=True: the target's layers are weak, so its
    greedy answer mostly repeats a token with occasional switches, and the head (fc averaging the
    captured inputs, LM head = the target's embedding, weak layer) drafts "the current token again":
    acceptance is partial (0..K) instead of always 0, while every path of the head still runs."""
    tparams = numpy_params(init_params, TARGET, seed=0, scale=0.3)
    hcfg = H.default_head_config("eagle3", TARGET)
    head = numpy_params(H.init_head, hcfg, seed=1, scale=0.02 if copying else 0.3)
    if copying:
        weak = numpy_params(init_params, TARGET, seed=5, scale=0.05)["layers"]
        tparams["layers"] = {k: v if "norm" in k else weak[k] for k, v in tparams["layers"].items()}
        D = TARGET.hidden_size
        head["fc"] = jnp.concatenate([jnp.eye(D)] * 3, 0) / 3.0
        head["lm_head"] = tparams["embed"].T
    return tparams, hcfg, head


def _sequences(tparams):
    """Prompt + greedy answer per row, padded; round starts are read off the traces."""
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
    calls = int(res.target_calls[b])
    return [(c, P + int(emitted[c - 1]) - 2) for c in range(1, calls)]


def test_ldlp_features_match_the_engine():
    tparams, hcfg, head = _setup()
    ldlp = init_ldlp(TARGET.hidden_size, jax.random.PRNGKey(3), hidden=16)
    ldlp["w_out"] = ldlp["w_out"] * 40.0  # spread the predictions over 1..K
    ldlp["b_out"] = jnp.float32(2.5)
    res = generate(tparams, TARGET, PROMPTS, max_new_tokens=MAX_NEW, drafter=EagleDrafter(hcfg), drafter_params=head,
                   policy=LDLPPolicy(k_max=K), policy_params=ldlp, k_max=K)
    tokens, _ = _sequences(tparams)
    from jspec.model import forward, init_cache

    out = forward(tparams, TARGET, jnp.asarray(tokens), init_cache(TARGET, *tokens.shape, jnp.float32))
    e, f = TL.round_pairs(tparams, jnp.asarray(tokens), out.hidden)
    expected = np.asarray(length_from_prediction(ldlp_apply(ldlp, e, f), K))
    seen = set()
    for b in range(len(PROMPTS)):
        for c, t in _round_starts(res, b):
            if t + K + 1 < len(PROMPTS[b]) + MAX_NEW:  # rounds cut by max_new draft less
                assert res.draft_lengths[b, c] == expected[b, t], (b, c, t)
                seen.add(int(expected[b, t]))
    assert len(seen) >= 2, seen  # the check saw different lengths, not one constant


def test_labels_match_accepted_counts():
    tparams, hcfg, head = _setup(copying=True)
    res = generate(tparams, TARGET, PROMPTS, max_new_tokens=MAX_NEW, drafter=EagleDrafter(hcfg), drafter_params=head,
                   policy="static", k_max=K)
    tokens, mask = _sequences(tparams)
    _, _, label, valid = TL.label_positions(hcfg, head, tparams, jnp.asarray(tokens), jnp.asarray(mask), k_max=K,
                                            logits_chunk=8)
    label, valid = np.asarray(label), np.asarray(valid)
    checked, seen = 0, set()
    for b in range(len(PROMPTS)):
        for c, t in _round_starts(res, b):
            if t + K + 2 < len(PROMPTS[b]) + MAX_NEW:  # the whole chain lies inside the answer
                assert valid[b, t]
                assert label[b, t] == res.step_tokens[b, c] - 1, (b, c, t)
                checked += 1
                seen.add(int(label[b, t]))
    assert checked >= 6 and 0 in seen and K in seen and len(seen) >= 3, (checked, seen)
