"""Trainable drafter networks: pure functions over plain parameter dicts.

    eagle   EAGLE-1 and EAGLE-3 feature heads (one decoder layer over the target's features)
"""
