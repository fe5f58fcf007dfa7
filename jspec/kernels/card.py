"""Facts about this process's first device that the kernels' block choices key on."""

from __future__ import annotations

import jax

SMS_FALLBACK = 132  # H100 SXM; used where the device does not report its core count (CPU tests, ROCm)


def card_name() -> str:
    """The device kind (e.g. "NVIDIA H100 80GB HBM3"): the key of the kernels' tuning tables."""
    try:
        return jax.devices()[0].device_kind
    except Exception:  # noqa: BLE001 - no device at all
        return "unknown"


def sm_count() -> int:
    try:
        return int(getattr(jax.devices()[0], "core_count", 0)) or SMS_FALLBACK
    except Exception:  # noqa: BLE001 - no device info: the H100's count
        return SMS_FALLBACK
