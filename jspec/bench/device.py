"""Which card the run is on, and how much device memory it used."""

from __future__ import annotations

import jax


def card_name() -> str:
    device = jax.devices()[0]
    return "cpu" if device.platform == "cpu" else str(device.device_kind)


def jax_peak_memory_bytes() -> int | None:
    """Peak bytes in use on the first JAX device since the process started (JAX has no reset), or
    None where the backend keeps no statistics (CPU)."""
    stats_fn = getattr(jax.devices()[0], "memory_stats", None)
    stats = stats_fn() if stats_fn else None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return int(stats["peak_bytes_in_use"])
