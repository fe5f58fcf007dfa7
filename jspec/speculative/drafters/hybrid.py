"""EAGLE head and n-gram prompt lookup in one draft tree, per row ("eagle3+ngram").

Which drafter wins depends on the text: prompt lookup on text that repeats its prompt
(summaries, retrieval answers, code edits), a trained head elsewhere. A hybrid tree holds both:
the head's EAGLE-2 tree, and beside it, as one more branch from the root, the n-gram drafter's
continuation of up to `TreeConfig.ngram` tokens (engines.tree builds it), at most MAX_NGRAM_BRANCH and
possibly deeper than the head's tree (the round then verifies, and may accept, a path of up to
max(depth, ngram) tokens). The n-gram branch is a
chain of point-mass drafts (q = 1), like every tree node, so the tree verifier and its lossless
rule are unchanged: a root may now have top_k + 1 children, one of them perhaps a duplicate of a
head child, which the rule (try children in order, zero a rejected token's p) then never accepts.

The state is both drafters' states; after verification both commit the accepted path.

Lookup first (`engines.tree.TreeConfig.lookup_first`, planned by `auto` at batch 1): a round in
which every row's n-gram match reached that order (`NgramDrafter.propose_ordered`) verifies the
n-gram branch alone and drafts none of the head's tree; the head still re-reads the accepted path.
"""

from __future__ import annotations

import dataclasses

from flax import struct

from ...config import ModelConfig
from .eagle import EagleDrafter, EagleState
from .ngram import NgramDrafter, NgramState

# [I] The longest n-gram branch: a round's verified path, its emitted tokens and the cache slots it
# reserves grow to max(depth, ngram) + 1. 8 is the chain engines' default k_max, the longest n-gram
# chain `auto` plans; on text that copies its prompt (longdoc) the branch pays past the head's depth
# (4 at batch 1 on the H100 table), where the head's tree has long stopped being accepted.
MAX_NGRAM_BRANCH = 8


@struct.dataclass
class HybridState:
    eagle: EagleState
    ngram: NgramState


@dataclasses.dataclass(frozen=True)
class HybridDrafter:
    """An EAGLE head's tree plus an n-gram branch (module doc). Trees only; dparams: the head's."""

    eagle: EagleDrafter
    ngram: NgramDrafter = NgramDrafter()
    name = "hybrid"
    parallel = False
    deterministic = False

    @property
    def head(self):
        return self.eagle.head

    @property
    def acceptance(self):
        return self.eagle.acceptance

    @property
    def acceptance_by_temperature(self):
        return self.eagle.acceptance_by_temperature

    @property
    def capture_layers(self):
        return self.eagle.capture_layers

    def check(self, tcfg: ModelConfig):
        self.eagle.check(tcfg)

    def init(self, dparams, tparams, tcfg, prompt, lens, first_token, prefill_out, cache_len):
        return HybridState(eagle=self.eagle.init(dparams, tparams, tcfg, prompt, lens, first_token, prefill_out, cache_len),
                           ngram=self.ngram.init(None, tparams, tcfg, prompt, lens, first_token, prefill_out, cache_len))

    def commit(self, dparams, tparams, tcfg, dstate: HybridState, block_tokens, n_accepted, next_token, verify_out):
        return HybridState(
            eagle=self.eagle.commit(dparams, tparams, tcfg, dstate.eagle, block_tokens, n_accepted, next_token, verify_out),
            ngram=self.ngram.commit(None, tparams, tcfg, dstate.ngram, block_tokens, n_accepted, next_token, verify_out))
