"""jspec: dynamic speculative decoding for JAX/Flax."""
