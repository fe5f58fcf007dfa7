"""jspec's forward pass against transformers (fp32) for every supported family.

One ragged batch per family covers prefill, a multi-token verify chunk and single-token cached
decode: row 0 has an 8-token prompt, row 1 a 4-token prompt right-padded to 8. The padding's K/V
lands beyond row 1's cursor and must stay invisible (slot 7 is still stale while the chunk runs).
Each row is compared with transformers run on that row alone, without padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_tiny import FAMILIES, hf_logits, make_tiny
from jspec import model

PROMPT_LENS = (8, 4)
CHUNK = 3  # tokens verified in one forward after prefill (speculative verify shape)
DECODE_STEPS = 2
MAX_LEN = 16
TOL = 1e-4  # max abs error / max abs reference logit


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def _jitted_step(cfg):
    def step(params, tokens, cache):
        out = model.forward(params, cfg, tokens, cache)
        return model.lm_head(params, cfg, out.hidden), out.cache

    return jax.jit(step)


@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_prefill_chunk_and_decode_match_transformers(family):
    hf, cfg, params = make_tiny(family)
    rng = np.random.RandomState(1)
    total = [n + CHUNK + DECODE_STEPS for n in PROMPT_LENS]
    seqs = [rng.randint(3, cfg.vocab_size, size=t) for t in total]
    refs = [hf_logits(hf, s[None])[0] for s in seqs]  # [len, V]: causal logits at every position
    step = _jitted_step(cfg)
    B = len(seqs)

    # Prefill: right-padded to the longest prompt; each row's cursor then moves by its own length.
    width = max(PROMPT_LENS)
    prompt = np.full((B, width), cfg.pad_token_id, np.int32)
    for b, n in enumerate(PROMPT_LENS):
        prompt[b, :n] = seqs[b][:n]
    logits, cache = step(params, jnp.asarray(prompt), model.init_cache(cfg, B, MAX_LEN))
    logits = np.asarray(logits)
    for b, n in enumerate(PROMPT_LENS):
        err = rel_err(logits[b, :n], refs[b][:n])
        assert err < TOL, f"{family} prefill row {b}: rel err {err:.2e}"
    cache = model.advance(cache, jnp.asarray(PROMPT_LENS, jnp.int32))

    # Verify chunk: CHUNK new tokens per row at different cursors.
    chunk = np.stack([s[n : n + CHUNK] for s, n in zip(seqs, PROMPT_LENS)])
    logits, cache = step(params, jnp.asarray(chunk, jnp.int32), cache)
    logits = np.asarray(logits)
    for b, n in enumerate(PROMPT_LENS):
        err = rel_err(logits[b], refs[b][n : n + CHUNK])
        assert err < TOL, f"{family} chunk row {b}: rel err {err:.2e}"
    cache = model.advance(cache, jnp.full((B,), CHUNK, jnp.int32))

    # Single-token decode.
    for i in range(DECODE_STEPS):
        pos = [n + CHUNK + i for n in PROMPT_LENS]
        tok = np.array([[s[p]] for s, p in zip(seqs, pos)], np.int32)
        logits, cache = step(params, jnp.asarray(tok), cache)
        logits = np.asarray(logits)
        for b, p in enumerate(pos):
            err = rel_err(logits[b, 0], refs[b][p])
            assert err < TOL, f"{family} decode step {i} row {b}: rel err {err:.2e}"
        cache = model.advance(cache, jnp.ones((B,), jnp.int32))
    assert np.asarray(cache.lengths).tolist() == total
