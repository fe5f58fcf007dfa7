"""Writing safetensors files as any other file is written, alone or as Hugging Face shards.

safetensors writes through a private temporary file (mode 0600) and renames it, so a head, a draft
model or predictor weights it wrote could not be read by another user of a shared host or a
serving engine running as one. `save_safetensors` gives the file the mode the umask allows.
`save_safetensors_shards` writes Hugging Face's sharded layout (shards and their index).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from safetensors.numpy import save_file

SAFETENSORS_INDEX = "model.safetensors.index.json"


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


def shards_of_at_most(tensors: Iterable[tuple[str, np.ndarray]], max_bytes: int) -> Iterator[dict[str, np.ndarray]]:
    """(name, tensor) pairs in order, grouped into dicts of at most `max_bytes` (a group closed when
    the next tensor would not fit; a tensor larger than that stands alone), produced one at a time."""
    group: dict[str, np.ndarray] = {}
    size = 0
    for name, tensor in tensors:
        if group and size + tensor.nbytes > max_bytes:
            yield group
            group, size = {}, 0
        group[name] = tensor
        size += tensor.nbytes
    yield group


def save_safetensors_shards(directory: str | os.PathLike, parts: Iterable[dict[str, np.ndarray]]) -> list[str]:
    """Hugging Face's sharded layout in `directory`: each of `parts` (dicts of tensors, taken one at
    a time, so a generator keeps one shard in memory) as model-0000i-of-0000N.safetensors, and
    SAFETENSORS_INDEX naming each tensor's file. Returns the names written, the index last."""
    directory = Path(directory)
    names: list[list[str]] = []
    total = 0
    for i, part in enumerate(parts):  # the shard count is known only at the end: written, then renamed
        save_safetensors(part, directory / f"model-part-{i:05d}.safetensors", metadata={"format": "pt"})
        names.append(list(part))
        total += int(sum(a.nbytes for a in part.values()))
    files, weight_map = [], {}
    for i, part_names in enumerate(names):
        final = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        os.replace(directory / f"model-part-{i:05d}.safetensors", directory / final)
        files.append(final)
        weight_map.update({n: final for n in part_names})
    (directory / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                          indent=1))
    return files + [SAFETENSORS_INDEX]
