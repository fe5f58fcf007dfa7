"""Drafters, one file per method: base (protocol, DrafterError), ngram, model, early_exit, eagle."""
