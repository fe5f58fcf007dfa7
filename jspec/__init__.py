"""jspec: dynamic speculative decoding for JAX/Flax."""

__version__ = "0.1.0"
