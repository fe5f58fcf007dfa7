"""Verification rules: chain (greedy identity, lossless sampling), tree (EAGLE-2), consultant (lossy)."""
