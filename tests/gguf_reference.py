"""transformers' own GGUF loader as the reference for jspec's, and a plain greedy decode of jspec's
model to compare with it (real quantized checkpoints, fp32, CPU).

transformers' `from_pretrained(dir, gguf_file=...)` insists on `accelerate`, which jspec does not
depend on, so the reference model is built the way that method does it: config from the GGUF
metadata, weights from transformers' `load_gguf_checkpoint` (its dequantization, tensor renaming,
Q/K un-permutation and Gemma norm handling), loaded into the transformers model class.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import CPU_FUSION_EMITTERS_KNOWN

from jspec import model
from jspec.checkpoint.errors import CheckpointNotFoundError
from jspec.checkpoint.gguf_io import fast_gguf_parsing
from jspec.presets import resolve_checkpoint


def preset_gguf(name: str) -> Path:
    """The GGUF file of a preset whose weights install from the package index (assembled and
    cached on first use); the test skips, with the reason, when its packages are not installed."""
    try:
        path, kind, _ = resolve_checkpoint(name)
    except CheckpointNotFoundError as e:
        pytest.skip(str(e))
    assert kind == "gguf", (name, kind)
    return path


@contextlib.contextmanager
def _one_parse_per_file():
    """transformers' GGUF path parses the file's metadata twice (config, then tensors: 262k vocabulary
    strings for Gemma) and rebuilds gguf's tensor-name map, a pure function of (arch, depth), once
    per submodule (~400 times for SmolLM2). Within this block one reader serves each file and one
    map each (arch, depth): the same parse results, computed once."""
    import gguf

    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def reader(path, *args, **kwargs):
        if args or kwargs:
            return reader_cls(path, *args, **kwargs)
        if str(path) not in readers:
            readers[str(path)] = reader_cls(path)
        return readers[str(path)]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


def transformers_from_gguf(path: Path):
    """A transformers fp32 model loaded by transformers' GGUF code path (see module docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with fast_gguf_parsing(), _one_parse_per_file():
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        with no_init_weights():
            hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        sd = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf, torch_dtype=torch.float32)["tensors"]
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert not missing or (set(missing) == {"lm_head.weight"} and config.tie_word_embeddings), missing
    hf.tie_weights()
    return hf.eval()


def jspec_greedy(cfg, params, prompts: list[list[int]], n_new: int) -> np.ndarray:
    """Greedy decode of a ragged batch: right-padded prefill, then one token per step. [B, n_new]."""
    B, width = len(prompts), max(map(len, prompts))
    tokens = np.full((B, width), cfg.pad_token_id, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)

    # conftest's XLA flags trade run time for compile time, right for the suite's tiny programs; this
    # 30-layer model's 31 decode steps would run 2-3x slower, so this one program keeps XLA's defaults.
    @functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 2, **(
        {"xla_cpu_use_fusion_emitters": True} if CPU_FUSION_EMITTERS_KNOWN else {})})
    def step(params, tokens, cache, last):
        out = model.forward(params, cfg, tokens, cache)
        hidden = jnp.take_along_axis(out.hidden, last[:, None, None], axis=1)[:, 0]
        return jnp.argmax(model.lm_head(params, cfg, hidden), axis=-1).astype(jnp.int32), out.cache

    cache = model.init_cache(cfg, B, width + n_new)
    nxt, cache = step(params, jnp.asarray(tokens), cache, lengths - 1)
    cache = model.advance(cache, lengths)
    generated = [nxt]
    zeros, ones = jnp.zeros((B,), jnp.int32), jnp.ones((B,), jnp.int32)
    for _ in range(n_new - 1):
        nxt, cache = step(params, nxt[:, None], cache, zeros)
        cache = model.advance(cache, ones)
        generated.append(nxt)
    return np.asarray(jnp.stack(generated, axis=1))


def until_eos(tokens, eos_ids) -> list[int]:
    out = []
    for t in tokens:
        out.append(int(t))
        if int(t) in eos_ids:
            break
    return out
