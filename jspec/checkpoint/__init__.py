"""Checkpoint I/O: Hugging Face safetensors, GGUF and Orbax to and from jspec's parameter layout.

Submodules (imported on demand, so `import jspec.checkpoint` stays light):
  hf        load_hf / export_hf / params_from_hf_state_dict
  streaming place_params (what load_hf streams through)
  gguf_io   load_gguf
  orbax_io  save_params / restore_params
  convert   convert / add_convert_args / run_convert
"""

from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingTensorError,
    TensorShapeError,
    UnknownArchitectureError,
    UnsupportedQuantizationError,
)

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "MissingTensorError",
    "TensorShapeError",
    "UnknownArchitectureError",
    "UnsupportedQuantizationError",
]
