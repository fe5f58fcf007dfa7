"""Hugging Face checkpoints (config.json + safetensors, single or sharded) to and from jspec.

Safetensors files are read from their headers with pread, tensor by tensor or in row ranges
(bfloat16 arrives as an ml_dtypes array), and `load_hf` streams them straight onto the device(s)
(streaming.py). Gemma3 stores norm weights as `w` and applies `1 + w`; jspec keeps
the applied multiplier, so `1` is added on load and subtracted on export.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from safetensors.numpy import load_file

from ..config import ModelConfig, UnsupportedModelError, config_from_hf
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingTensorError,
    TensorShapeError,
    UnknownArchitectureError,
)
from .files import SAFETENSORS_INDEX, save_safetensors
from .layout import build_params, check_shape, expected_shape, global_tensor_names, layer_tensor_names, split_params
from .streaming import place_params

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_FILE = "model.safetensors"

# model_type values config_from_hf understands (gemma3 = the multimodal wrapper with text_config).
_HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")

# Prefixes under which Gemma3 multimodal checkpoints keep the text decoder, mapped to the plain
# causal-LM names. Order matters: the longest, most specific prefix first.
_NAME_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)

_LLAMA_LAYER_NAMES = {
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "attn_norm": "input_layernorm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
}

# Gemma's sandwich norms: HF's post_attention_layernorm is the norm *after* attention, and the
# pre-MLP norm has its own name.
_GEMMA_LAYER_NAMES = {
    **_LLAMA_LAYER_NAMES,
    "post_attn_norm": "post_attention_layernorm.weight",
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}

_GLOBAL_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}

_HF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}


def hf_tensor_name(cfg: ModelConfig, name: str, layer: int | None) -> str:
    """Hugging Face state-dict name of a logical tensor (see layout.py)."""
    if layer is None:
        return _GLOBAL_NAMES[name]
    table = _GEMMA_LAYER_NAMES if cfg.arch == "gemma3" else _LLAMA_LAYER_NAMES
    return f"model.layers.{layer}.{table[name]}"


def _is_gemma_norm(cfg: ModelConfig, name: str) -> bool:
    return cfg.arch == "gemma3" and name.endswith("norm")


def normalize_name(name: str) -> str:
    for prefix, replacement in _NAME_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return name


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: file not found")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: not valid JSON ({e})") from e


def _model_type_of(hf: dict) -> str:
    return str(hf.get("model_type", ""))


def _with_transformers_defaults(model_dir: Path, hf: dict) -> dict:
    """The config as transformers sees it: class defaults filled in for keys the file omits.

    Older config.json files leave out values equal to the defaults of the transformers version
    that wrote them (Mistral's sliding window, Gemma's layer pattern); reading them through
    transformers keeps jspec's interpretation identical to the reference implementation.
    """
    try:
        from transformers import AutoConfig
    except ImportError:  # transformers is optional at run time: fall back to the file as written
        return hf
    try:
        return AutoConfig.from_pretrained(str(model_dir)).to_dict()
    except Exception as e:  # noqa: BLE001 - any parser failure is a corrupt config for us
        raise CorruptCheckpointError(f"{model_dir / CONFIG_FILE}: transformers cannot parse it ({e})") from e


def _check_unsupported_features(hf: dict, source: str) -> None:
    """Reject config options jspec's forward would silently ignore."""
    text = hf.get("text_config", hf) if _model_type_of(hf) == "gemma3" else hf
    mt = _model_type_of(hf)
    if mt in ("gemma3", "gemma3_text"):
        act = text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnknownArchitectureError(f"{source}: Gemma3 activation {act!r} is not supported (gelu_pytorch_tanh)")
    else:
        act = text.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnknownArchitectureError(f"{source}: activation {act!r} is not supported (silu)")
    if mt == "qwen3" and text.get("use_sliding_window"):
        raise UnknownArchitectureError(f"{source}: qwen3 use_sliding_window=True is not supported")


def config_from_hf_file(model_dir: Path) -> ModelConfig:
    """ModelConfig from <dir>/config.json, with eos ids merged from generation_config.json."""
    path = model_dir / CONFIG_FILE
    raw = read_json(path)
    mt = _model_type_of(raw)
    if mt not in _HF_MODEL_TYPES:
        raise UnknownArchitectureError(
            f"{path}: unknown model_type {mt!r}; supported: {', '.join(_HF_MODEL_TYPES)}"
        )
    hf = _with_transformers_defaults(model_dir, raw)
    _check_unsupported_features(hf, str(path))
    try:
        cfg = config_from_hf(hf)
    except UnsupportedModelError as e:
        raise UnknownArchitectureError(f"{path}: {e}") from e
    except (KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{path}: missing or malformed config entry ({e})") from e
    return cfg.replace(eos_token_ids=_merged_eos_ids(model_dir, cfg.eos_token_ids))


def _merged_eos_ids(model_dir: Path, eos: tuple[int, ...]) -> tuple[int, ...]:
    """Chat models often list extra stop tokens (end of turn) only in generation_config.json."""
    gen_path = model_dir / GENERATION_CONFIG_FILE
    if not gen_path.is_file():
        return eos
    gen_eos = read_json(gen_path).get("eos_token_id")
    extra = gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
    return tuple(dict.fromkeys([*eos, *(int(t) for t in extra)]))


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------


# safetensors dtype tags jspec reads (weights are floating point; anything else is not a decoder).
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.dtype(jnp.bfloat16)}

# A safetensors header is a few MB even for the largest checkpoints; a larger length is garbage.
_MAX_HEADER_BYTES = 100 << 20


class _SafetensorsFile:
    """One .safetensors file: its header parsed, tensors (or row ranges of them) read with pread
    into fresh buffers. Reading through the page cache instead of a memory map keeps the file's
    pages out of this process's resident memory, so a whole checkpoint can stream through."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                if n < 2 or n > min(size - 8, _MAX_HEADER_BYTES):
                    raise CorruptCheckpointError(f"{path}: cannot read safetensors header (length field {n}, file "
                                                 f"{size} bytes); truncated or not safetensors?")
                header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"{path}: safetensors header is not valid JSON ({e}); truncated or not safetensors?") from e
        if not isinstance(header, dict):
            raise CorruptCheckpointError(f"{path}: safetensors header is not a JSON object; not safetensors?")
        header.pop("__metadata__", None)
        self.tensors: dict[str, dict] = header
        self.data_start = 8 + n
        for name, info in header.items():
            try:
                begin, end = (int(x) for x in info["data_offsets"])
                shape = tuple(int(d) for d in info["shape"])
                info["dtype"]
            except (KeyError, TypeError, ValueError) as e:
                raise CorruptCheckpointError(f"{path}: malformed header entry for {name!r} ({e})") from e
            if self.data_start + end > size or begin > end:
                raise CorruptCheckpointError(
                    f"{path}: tensor {name!r} ends at byte {self.data_start + end}, past the end of the file "
                    f"({size} bytes); file truncated?"
                )
            tag = info["dtype"]
            if tag in _SAFETENSORS_DTYPES:
                need = int(np.prod(shape, dtype=np.int64)) * np.dtype(_SAFETENSORS_DTYPES[tag]).itemsize
                if end - begin != need:
                    raise CorruptCheckpointError(f"{path}: tensor {name!r} has {end - begin} bytes; its shape {shape} "
                                                 f"and dtype {tag} need {need}")
            info["shape"], info["data_offsets"] = shape, (begin, end)
        self._fd: int | None = None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name]["shape"]

    def dtype(self, name: str) -> np.dtype:
        tag = self.tensors[name]["dtype"]
        if tag not in _SAFETENSORS_DTYPES:
            raise CorruptCheckpointError(
                f"{self.path}: tensor {name!r} has dtype {tag}; supported: {', '.join(_SAFETENSORS_DTYPES)}"
            )
        return np.dtype(_SAFETENSORS_DTYPES[tag])

    def read_rows(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop) along the first axis (one contiguous read), in the stored dtype, or
        written into `out` (converted to its dtype; read in place when that is the stored one)."""
        info = self.tensors[name]
        shape, dtype = info["shape"], self.dtype(name)
        begin = info["data_offsets"][0]
        if not shape:
            start, stop = 0, 1
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        if out is not None and (out.dtype != dtype or not out.flags.c_contiguous):
            out[...] = self.read_rows(name, start, stop)
            return out
        if out is None:
            out = np.empty((stop - start, *shape[1:]), dtype)
        elif out.shape != (stop - start, *shape[1:]):
            raise ValueError(f"read_rows: out has shape {out.shape}, rows {start}:{stop} of {name!r} are {(stop - start, *shape[1:])}")
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        view = memoryview(out.reshape(-1).view(np.uint8))
        offset, done = self.data_start + begin + start * row_bytes, 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise CorruptCheckpointError(f"{self.path}: tensor {name!r} cut short at byte {offset + done}; file truncated?")
            done += got
        return out.reshape(shape) if not shape else out

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


def check_safetensors_file(path: str | os.PathLike) -> None:
    """Raise CorruptCheckpointError (naming the file) unless its header parses and every tensor
    it lists lies inside the file: a truncated download is caught without reading a weight."""
    _SafetensorsFile(Path(path))


def load_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file, checked first (check_safetensors_file), so a truncated
    file is one line naming it rather than the reader's own error."""
    check_safetensors_file(path)
    return load_file(str(path))


class SafetensorsDir:
    """Name -> tensor access over one or several safetensors files of a directory.

    Every header is read when it opens, so a missing shard, a truncated file or a tensor the index
    names but its shard lacks is reported before any weight is read."""

    def __init__(self, model_dir: Path):
        self.source = str(model_dir)
        self.files: dict[str, _SafetensorsFile] = {}  # normalized tensor name -> its file
        self.original: dict[str, str] = {}  # normalized -> name as stored
        index = model_dir / SAFETENSORS_INDEX
        single = model_dir / SINGLE_FILE
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CorruptCheckpointError(f"{index}: no 'weight_map' object")
            opened: dict[str, _SafetensorsFile] = {}
            for shard in sorted(set(weight_map.values())):
                file = model_dir / shard
                if not file.is_file():
                    raise CheckpointNotFoundError(f"{file}: shard listed in {SAFETENSORS_INDEX} is missing")
                opened[shard] = _SafetensorsFile(file)
            for name, shard in weight_map.items():
                if name not in opened[shard].tensors:
                    raise MissingTensorError(f"{model_dir / shard}: tensor {name!r} listed in {SAFETENSORS_INDEX} is not in this shard")
                self._add(name, opened[shard])
        elif single.is_file():
            file = _SafetensorsFile(single)
            for name in file.tensors:
                self._add(name, file)
        else:
            raise CheckpointNotFoundError(
                f"{model_dir}: no {SINGLE_FILE} or {SAFETENSORS_INDEX} (only safetensors checkpoints are supported)"
            )

    def _add(self, name: str, file: _SafetensorsFile) -> None:
        key = normalize_name(name)
        self.files[key] = file
        self.original[key] = name

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _file(self, name: str) -> _SafetensorsFile:
        file = self.files.get(name)
        if file is None:
            raise MissingTensorError(f"{self.source}: tensor {name!r} is missing from the checkpoint")
        return file

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(name).shape(self.original[name])

    def dtype(self, name: str) -> np.dtype:
        return self._file(name).dtype(self.original[name])

    def read_rows(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        return self._file(name).read_rows(self.original[name], start, stop, out)

    def get(self, name: str) -> np.ndarray:
        shape = self.shape(name)
        return self.read_rows(name, 0, shape[0] if shape else 1).astype(np.float32)


class StateDict:
    """The same access over an in-memory {name: array} dict (numpy or torch tensors)."""

    def __init__(self, sd: dict[str, Any], source: str = "state_dict"):
        self.source = source
        self.tensors = {normalize_name(k): v for k, v in sd.items()}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise MissingTensorError(f"{self.source}: tensor {name!r} is missing from the state dict")
        value = self.tensors[name]
        if hasattr(value, "detach"):  # torch tensor (possibly bfloat16, which numpy lacks)
            value = value.detach().float().cpu().numpy()
        return np.asarray(value).astype(np.float32)


def _reject_output_bias(cfg: ModelConfig, tensors) -> None:
    """Llama/Qwen3/Gemma `attention_bias` also adds an o_proj bias, which jspec does not model."""
    for layer in range(cfg.num_layers):
        name = f"model.layers.{layer}.self_attn.o_proj.bias"
        if name in tensors and np.any(tensors.get(name) != 0):
            raise UnknownArchitectureError(f"{tensors.source}: non-zero {name} (output-projection bias) is not supported")


def _fetch_from(cfg: ModelConfig, tensors) -> Callable:
    def fetch(name: str, layer: int | None, shape: tuple) -> np.ndarray:
        hf_name = hf_tensor_name(cfg, name, layer)
        array = check_shape(tensors.get(hf_name), shape, hf_name, tensors.source)
        if _is_gemma_norm(cfg, name):
            array = array + 1.0
        return array

    return fetch


def params_from_hf_state_dict(cfg: ModelConfig, sd: dict[str, Any], dtype=jnp.float32, source: str = "state_dict") -> dict:
    """jspec params from a Hugging Face state dict ({name: numpy array or torch tensor})."""
    tensors = StateDict(sd, source)
    _reject_output_bias(cfg, tensors)
    return build_params(cfg, _fetch_from(cfg, tensors), dtype)


def _check_tensors(cfg: ModelConfig, tensors: SafetensorsDir) -> None:
    """Every tensor the config needs is present, of the implied shape and a float dtype: checked
    from the headers alone, before any weight is read."""
    needed = [(name, None) for name in global_tensor_names(cfg)]
    needed += [(name, l) for l in range(cfg.num_layers) for name in layer_tensor_names(cfg)]
    for name, layer in needed:
        hf_name = hf_tensor_name(cfg, name, layer)
        shape = tuple(tensors.shape(hf_name))
        if shape != expected_shape(cfg, name):
            raise TensorShapeError(f"{tensors.source}: tensor {hf_name!r} has shape {shape}, "
                                   f"but the config implies {expected_shape(cfg, name)}")
        tensors.dtype(hf_name)  # raises on a dtype jspec cannot read


def _rows_from(cfg: ModelConfig, tensors: SafetensorsDir):
    def rows(name: str, layer: int | None, start: int, out: np.ndarray) -> None:
        hf_name = hf_tensor_name(cfg, name, layer)
        if _is_gemma_norm(cfg, name):
            out[...] = tensors.read_rows(hf_name, start, start + len(out)).astype(np.float32) + 1.0
        else:
            tensors.read_rows(hf_name, start, start + len(out), out)

    return rows


def load_hf(path: str | os.PathLike, dtype=jnp.float32, *, mesh: Mesh | None = None, device=None) -> tuple[ModelConfig, dict]:
    """(config, params) from a Hugging Face model directory (one file or sharded with an index).

    The weights stream from the files onto JAX's default device (uncommitted, as jnp.asarray would
    place them), onto `device`, or, with `mesh`, straight into their shards (sharding.PARAM_AXES),
    one layer of one leaf at a time, converted to `dtype` on the way (streaming.py): the host never
    holds a copy of the model.
    """
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise CheckpointNotFoundError(f"{model_dir}: Hugging Face model directory not found")
    cfg = config_from_hf_file(model_dir)
    tensors = SafetensorsDir(model_dir)
    _check_tensors(cfg, tensors)
    _reject_output_bias(cfg, tensors)
    return cfg, place_params(cfg, _rows_from(cfg, tensors), dtype, mesh=mesh, device=device)


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


def _rope_parameters(cfg: ModelConfig, theta: float, scaling: tuple | None) -> dict:
    rp: dict[str, Any] = {"rope_type": "default", "rope_theta": float(theta)}
    if scaling is None:
        return rp
    if scaling[0] == "linear":
        return {**rp, "rope_type": "linear", "factor": float(scaling[1])}
    if scaling[0] == "llama3":
        _, factor, low, high, orig = scaling
        return {
            **rp,
            "rope_type": "llama3",
            "factor": float(factor),
            "low_freq_factor": float(low),
            "high_freq_factor": float(high),
            "original_max_position_embeddings": int(orig),
        }
    raise UnsupportedModelError(f"cannot export rope scaling {scaling[0]!r}")


def _int_if_integral(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


def hf_config_dict(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
    """A transformers config.json for cfg's family (transformers >= 5 `rope_parameters` form)."""
    model_type, architecture = _HF_ARCHITECTURES[cfg.arch]
    eos = list(cfg.eos_token_ids)
    d: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": cfg.pad_token_id,
        "dtype": torch_dtype,
    }
    if cfg.arch == "gemma3":
        local_theta = cfg.rope_local_theta or 10000.0
        d.update(
            hidden_activation="gelu_pytorch_tanh",
            attention_bias=cfg.attention_bias,
            # transformers validates this field as an int
            query_pre_attn_scalar=_int_if_integral(cfg.query_pre_attn_scalar or cfg.head_dim),
            sliding_window=cfg.sliding_window,
            layer_types=["sliding_attention" if s else "full_attention" for s in cfg.sliding_layers],
            final_logit_softcapping=cfg.final_logit_softcap,
            attn_logit_softcapping=cfg.attn_logit_softcap,
            rope_parameters={
                "full_attention": _rope_parameters(cfg, cfg.rope_theta, cfg.rope_scaling),
                "sliding_attention": _rope_parameters(cfg, local_theta, None),
            },
        )
        return d
    d.update(hidden_act="silu", rope_parameters=_rope_parameters(cfg, cfg.rope_theta, cfg.rope_scaling))
    if cfg.arch in ("llama", "qwen3"):
        d["attention_bias"] = cfg.attention_bias
    if cfg.arch == "mistral":
        d["sliding_window"] = cfg.sliding_window if cfg.has_sliding else None
    elif cfg.has_sliding:
        raise UnsupportedModelError(f"cannot export sliding-window attention for arch {cfg.arch!r}")
    if cfg.arch == "qwen2":
        d["use_sliding_window"] = False
    return d


def hf_state_dict(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """{HF name: numpy array} in the params' dtype (float32 or bfloat16)."""
    sd = {}
    for name, layer, array in split_params(cfg, params):
        if _is_gemma_norm(cfg, name):
            array = (array.astype(np.float32) - 1.0).astype(array.dtype)
        sd[hf_tensor_name(cfg, name, layer)] = array
    if cfg.attention_bias and cfg.arch != "qwen2":
        # These families' attention_bias flag also creates an o_proj bias; jspec has none, so
        # write zeros rather than let transformers initialise it randomly.
        dtype = sd[hf_tensor_name(cfg, "embed", None)].dtype
        for layer in range(cfg.num_layers):
            sd[f"model.layers.{layer}.self_attn.o_proj.bias"] = np.zeros((cfg.hidden_size,), dtype)
    return sd


def export_hf(params: dict, cfg: ModelConfig, out_dir: str | os.PathLike) -> Path:
    """Write config.json + model.safetensors that transformers' AutoModelForCausalLM loads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = hf_state_dict(cfg, params)
    dtype_name = "bfloat16" if str(next(iter(sd.values())).dtype) == "bfloat16" else "float32"
    (out / CONFIG_FILE).write_text(json.dumps(hf_config_dict(cfg, dtype_name), indent=2) + "\n")
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids) or None}
    (out / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
    save_safetensors(sd, out / SINGLE_FILE, metadata={"format": "pt"})
    return out


__all__ = [
    "config_from_hf_file",
    "check_safetensors_file",
    "export_hf",
    "hf_config_dict",
    "hf_state_dict",
    "hf_tensor_name",
    "load_hf",
    "load_safetensors",
    "params_from_hf_state_dict",
]
