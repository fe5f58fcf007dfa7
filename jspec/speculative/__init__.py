"""Speculative decoding, in layers (each imports only those listed before it):

    state.py     SpecState carried by the engines' while_loop, per-call traces, result conversion
    drafters/    who proposes tokens: ngram, model, early_exit, eagle (protocol in base.py)
    verify/      which drafted tokens are kept: chain, tree (EAGLE-2), consultant (lossy)
    policies/    how many tokens to draft: one file per method, registry in __init__.py
    engines/     one jitted loop per decoding shape: chain, tree
    factory.py   build a drafter from a spec string ("ngram:3", "eagle3", "model:PATH")
    config.py    SpeculativeConfig: drafter, policy, k_max or tree, verify rule, engine; checked when built

jspec.generate (the host API) sits above all of them.
"""
