"""How much device memory a run used (which card it ran on: jspec.cards)."""

from __future__ import annotations

import jax


def jax_peak_memory_bytes() -> int | None:
    """Peak bytes in use on the first JAX device since the process started (JAX has no reset), or
    None where the backend keeps no statistics (CPU)."""
    stats_fn = getattr(jax.devices()[0], "memory_stats", None)
    stats = stats_fn() if stats_fn else None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return int(stats["peak_bytes_in_use"])
