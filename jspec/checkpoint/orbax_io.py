"""jspec params as an Orbax checkpoint, with the ModelConfig as JSON beside it.

Directory layout:
    <path>/jspec_config.json   ModelConfig.to_dict() plus a format tag
    <path>/params/             orbax StandardCheckpointer tree (dtypes preserved)
    <path>/tokenizer/          optional: the source's tokenizer (written by `convert`)
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import jax

from ..config import ModelConfig, UnsupportedModelError
from .errors import CheckpointNotFoundError, CorruptCheckpointError, UnknownArchitectureError

CONFIG_FILE = "jspec_config.json"
PARAMS_DIR = "params"
FORMAT_TAG = "jspec-orbax-v1"


def is_orbax_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / CONFIG_FILE).is_file() and (p / PARAMS_DIR).is_dir()


def save_params(path: str | os.PathLike, params: dict, cfg: ModelConfig, *, overwrite: bool = False) -> Path:
    """Write params + config under `path` (a directory). Refuses to clobber unless `overwrite`."""
    import orbax.checkpoint as ocp

    root = Path(path).absolute()  # orbax requires absolute paths
    if root.exists() and any(root.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{root}: directory exists and is not empty (pass overwrite=True)")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(root / PARAMS_DIR, params)
    checkpointer.wait_until_finished()
    (root / CONFIG_FILE).write_text(json.dumps({"format": FORMAT_TAG, "config": cfg.to_dict()}, indent=2) + "\n")
    return root


def read_config(path: str | os.PathLike) -> ModelConfig:
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise CheckpointNotFoundError(f"{file}: not found; {path} is not a jspec Orbax checkpoint")
    try:
        blob = json.loads(file.read_text())
        return ModelConfig.from_dict(blob["config"])
    except UnsupportedModelError as e:
        raise UnknownArchitectureError(f"{file}: {e}") from e
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{file}: malformed jspec config ({e})") from e


def restore_params(path: str | os.PathLike, device=None) -> tuple[ModelConfig, dict]:
    """(config, params) from a directory written by save_params; arrays land on `device`
    (default: the first local device), whatever devices the checkpoint was saved from."""
    import orbax.checkpoint as ocp

    root = Path(path).absolute()
    cfg = read_config(root)
    params_dir = root / PARAMS_DIR
    if not params_dir.is_dir():
        raise CheckpointNotFoundError(f"{params_dir}: parameter directory missing")
    checkpointer = ocp.StandardCheckpointer()
    sharding = jax.sharding.SingleDeviceSharding(device or jax.local_devices()[0])
    error = None
    try:
        meta = checkpointer.metadata(params_dir)
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=sharding), tree)
        with _muted_async_reporters():
            params = checkpointer.restore(params_dir, target)
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for a bad tree
        error = f"{params_dir}: cannot restore Orbax checkpoint, truncated or corrupt? ({_root_cause(e)})"
    if error is not None:  # out here, where the exception's frames no longer hold the failed reads
        with _muted_async_reporters():
            for _ in range(3):  # the other reads were still in flight: let them land, then collect them
                time.sleep(0.1)
                gc.collect()
        raise CorruptCheckpointError(error)
    return cfg, params


def _root_cause(e: BaseException) -> str:
    """The innermost cause's message on one line: tensorstore's names the file and the byte range,
    where orbax's wrapper prints the whole TensorStore spec (a thousand characters)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


@contextlib.contextmanager
def _muted_async_reporters():
    """When one array of a checkpoint fails to read, orbax returns while the other reads are still
    in flight: their coroutines and tensorstore callbacks report later (unraisable exceptions,
    asyncio's log, 'Event loop is closed' from worker threads), dozens of traceback lines after
    the one error that matters. Those reporters stay muted while the restore and its clean-up run."""
    hooks = sys.unraisablehook, threading.excepthook, sys.excepthook
    log = logging.getLogger("asyncio")
    level = log.level
    sys.unraisablehook = threading.excepthook = sys.excepthook = lambda *_: None
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        sys.unraisablehook, threading.excepthook, sys.excepthook = hooks
        log.setLevel(level)


__all__ = ["is_orbax_dir", "read_config", "restore_params", "save_params"]
