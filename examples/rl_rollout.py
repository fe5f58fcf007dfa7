"""RL rollout step: sample completions with lossless speculative decoding (T = 1) and score them
with the target's log-probs, all in ONE jitted program of your own.

    python examples/rl_rollout.py --tiny                       # random tiny model, runs anywhere
    python examples/rl_rollout.py --model smollm2-135m-instruct --drafter eagle3

`speculative_generate_jit` is a pure function (no host round trip inside), so it composes with
your own `jax.jit`: the rollout, the log-probs of the sampled tokens under the target (what a
policy-gradient loss needs), and any reward you compute on device run as one XLA program.
With lossless verification the completions are distributed exactly as the target's own T = 1
samples; the drafter only changes how many target calls it takes. `--rows N` keeps N rows in flight
over more prompts (continuous batching inside the same program: a finished row takes the next
prompt), for rollout batches larger than what fits at once.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jspec import model as M
from jspec.decode import pack_prompts
from jspec.sampling import Sampling
from jspec.scoring import completion_logprobs
from jspec.speculative.engines.chain import speculative_generate_jit
from jspec.speculative.factory import build_drafter
from jspec.speculative.policies import resolve_policy

T1 = Sampling(temperature=1.0)


def make_rollout_step(cfg, drafter, *, k_max: int, max_new: int, cache_len: int, policy="static", rows=None):
    """Your own jitted step: (params, drafter params, prompts, lens, key) -> completions, lengths,
    per-token target log-probs, acceptance rate. Static choices are closed over; `rows`: rows in
    flight (None: every prompt at once)."""
    policy = resolve_policy(policy, k_max)

    @jax.jit
    def rollout_step(params, dparams, prompts, prompt_lens, key):
        out, n_new, calls, drafted, accepted, _, _ = speculative_generate_jit(
            params, dparams, None, prompts, prompt_lens, key, tcfg=cfg, drafter=drafter, policy=policy, k_max=k_max,
            max_new=max_new, cache_len=cache_len, sampling=T1, verify="lossless", unroll=1, rows=rows)
        lp = completion_logprobs(params, cfg, prompts, prompt_lens, out, n_new)
        return {"tokens": out, "lengths": n_new, "logprobs": lp, "target_calls": calls,
                "acceptance": jnp.sum(accepted) / jnp.maximum(jnp.sum(drafted), 1)}

    return rollout_step


def tiny_model():
    from jspec.config import ModelConfig

    cfg = ModelConfig(arch="llama", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, eos_token_ids=(3,), max_position_embeddings=256)
    # a large init scale gives peaked distributions, so n-gram drafts get accepted now and then
    return cfg, M.init_params(cfg, jax.random.PRNGKey(0), scale=0.35), None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="random tiny target (CI); else --model")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="ngram", help="ngram, eagle3, early-exit:E, ... (jspec.speculative.factory)")
    ap.add_argument("--k-max", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", type=int, default=None, help="rows in flight (continuous batching); default all prompts")
    a = ap.parse_args(argv)

    if a.tiny:
        cfg, params, tok = tiny_model()
        prompts = [[5, 6, 7, 5, 6, 7], [9, 10, 11], [20, 21, 20, 21], [30]]
    else:
        from jspec.presets import resolve_model
        from jspec.tokenizer import prompt_ids

        cfg, params, tok = resolve_model(a.model)
        prompts = [prompt_ids(tok, q, True) for q in ("Write a haiku about JAX.", "Name three prime numbers.")]
    drafter, dparams = build_drafter(a.drafter, cfg, params, model_name=None if a.tiny else a.model)
    tokens, lens, cache_len = pack_prompts(cfg, prompts, a.max_new_tokens, a.k_max + 1)
    step = make_rollout_step(cfg, drafter, k_max=a.k_max, max_new=a.max_new_tokens, cache_len=cache_len, rows=a.rows)
    res = jax.device_get(step(params, dparams, jnp.asarray(tokens), jnp.asarray(lens), jax.random.PRNGKey(a.seed)))
    for b in range(len(prompts)):
        n = int(res["lengths"][b])
        text = tok.decode(res["tokens"][b, :n].tolist()) if tok is not None else res["tokens"][b, :n].tolist()
        print(f"[{b}] {n} tokens, sum log p = {float(np.sum(res['logprobs'][b])):.2f}: {text!r}")
    print(f"acceptance {float(res['acceptance']):.2f}, target calls {res['target_calls'].tolist()}")
    return res


if __name__ == "__main__":
    main()
