"""Speculative engines, each one jitted `lax.while_loop` over rounds: chain, tree (EAGLE-2)."""
