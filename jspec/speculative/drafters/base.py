"""Drafters: who proposes the tokens the target verifies.

Two shapes of drafter, both frozen (hashable) dataclasses whose weights travel separately as a
pytree (`dparams`), so the whole speculative loop is one jitted function:

* Autoregressive drafters (EAGLE heads, a small draft model, the target's early exit) produce one
  distribution per step. The engine drives them through
      begin(dparams, tparams, tcfg, dstate, tcache, last_token) -> (logits [B, V], carry, consts)
      step(dparams, tparams, tcfg, consts, carry, token [B])     -> (logits [B, V], carry)
      finish(consts, carry)                                       -> (dstate, tcache)
  so the engine owns the loop, the policy's stop decisions and the sampling. `carry` holds only
  what the steps change and `consts` what they read (the round's starting state, lookup tables):
  the engine runs the steps in loops and branches whose carried values XLA copies where they
  pass through unchanged (a target cache is megabytes). While drafting, a drafter may advance its
  cache cursor as if its drafts were committed (chain attention is then plain causal attention);
  `finish` rewinds it.
* Parallel drafters (n-gram prompt lookup) propose all K tokens at once:
      propose(dstate, last_token, k) -> (tokens [B, K], valid [B, K])

After verification every drafter gets
      commit(dparams, tparams, tcfg, dstate, block_tokens [B, K+1], n_accepted [B], next_token [B], verify_out)
with the verified block ([last_token, d_1..d_K]) and the target's ForwardOut over it, and returns
its state for the next round. `init(...)` builds the state after the target's prefill. A drafter
may define `loop_params(dparams)`: its weights as the round loop should read them
(`drafter_loop_params`).

One file per drafter: ngram.py, model.py, early_exit.py, eagle.py. `factory.build_drafter` builds
one from a spec string.
"""

from __future__ import annotations


class DrafterError(ValueError):
    """The drafter cannot serve this target (vocabulary mismatch, missing weights, bad option)."""


def drafter_loop_params(drafter, dparams):
    """The drafter weights a round loop should close over. A drafter that runs a model of its own
    defines `loop_params(dparams)` (the draft model: per-layer weight buffers, as
    `model.loop_params` gives the target's); the others' weights are read as they are."""
    own = getattr(drafter, "loop_params", None)
    return dparams if own is None or dparams is None else own(dparams)
