"""One exception class per way a checkpoint can be unusable.

Every message names the file (or directory) and the problem, so a user can act on it without a
traceback. All classes subclass ValueError or FileNotFoundError, so generic handlers still work.
"""

from __future__ import annotations

from ..config import UnsupportedModelError


class CheckpointError(ValueError):
    """Base class of the ValueError-type checkpoint problems below."""


class CheckpointNotFoundError(FileNotFoundError):
    """A checkpoint file or directory, or a required file inside it, does not exist."""


class CorruptCheckpointError(CheckpointError):
    """The file exists but cannot be parsed: truncated, not the claimed format, inconsistent."""


class UnknownArchitectureError(CheckpointError, UnsupportedModelError):
    """The checkpoint's architecture / model_type is not one jspec implements."""


class UnsupportedQuantizationError(CheckpointError, UnsupportedModelError):
    """A GGUF tensor uses a quantization type that cannot be dequantized."""


class MissingTensorError(CheckpointError):
    """A tensor the architecture needs is absent from the checkpoint."""


class TensorShapeError(CheckpointError):
    """A tensor's shape disagrees with the shape the config implies."""
