"""Writing safetensors files as any other file is written.

safetensors writes through a private temporary file (mode 0600) and renames it, so a head, a draft
model or predictor weights it wrote could not be read by another user of a shared host or a
serving engine running as one. `save_safetensors` gives the file the mode the umask allows.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def save_safetensors(tensors: dict[str, np.ndarray], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> Path:
    """Write `tensors` to `path` (safetensors), readable as the umask allows (0644 under 022)."""
    path = Path(path)
    save_file(tensors, str(path), metadata=metadata)
    readable_as_umask_allows(path)
    return path


def readable_as_umask_allows(path: Path) -> None:
    """Give `path` the mode a newly written file gets: 0666 less the umask."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)
