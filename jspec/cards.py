"""Which card a run is on: one name for rows and tables, one key for file names.

`card_name()` is the first device's kind as JAX reports it ("NVIDIA H200", "NVIDIA H100 80GB HBM3";
"cpu" on the CPU): benchmark rows, the matvec kernel's tuning table. `card_key()` is the same with
spaces as underscores ("NVIDIA_H200"): round-cost table file names, calibration entries.
"""

from __future__ import annotations

import jax


def card_name() -> str:
    device = jax.devices()[0]
    return "cpu" if device.platform == "cpu" else str(getattr(device, "device_kind", device.platform))


def card_key() -> str:
    return card_name().replace(" ", "_")
