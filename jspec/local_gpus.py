"""Which GPUs of this host a script's one-process-per-GPU children may take (no JAX import, so a
parent process never opens a GPU context of its own)."""

from __future__ import annotations

import os
import subprocess


def listed_gpus() -> int:
    """GPUs on this host (nvidia-smi -L), at least 1."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 1
    return max(1, sum(line.startswith("GPU ") for line in out.splitlines()))


def gpu_ids(count: int | None = None) -> list[str]:
    """The GPU ids (each a child's CUDA_VISIBLE_DEVICES) of the first `count` GPUs this process may
    use: those $CUDA_VISIBLE_DEVICES names when it is set, else 0..count-1 (count None: every GPU
    the host lists). A script started on GPUs 2,3 thus puts its children on 2 and 3, never on 0 and
    1 beside whatever else runs there (a cost table timed that way planned on bad numbers).
    Raises ValueError when CUDA_VISIBLE_DEVICES names fewer than `count`."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else None
    if count is None:
        return ids if ids else [str(g) for g in range(listed_gpus())]
    if ids is None:
        return [str(g) for g in range(count)]
    if len(ids) < count:
        raise ValueError(f"{count} GPU(s) asked for, but CUDA_VISIBLE_DEVICES={visible} names {len(ids)}")
    return ids[:count]
