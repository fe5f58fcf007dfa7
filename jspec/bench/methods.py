"""Method adapters: jspec's own generate (AR and speculative) and transformers' generate as a peer.

Both block until the generated ids are numpy / Python lists on the host, so the harness's
perf_counter brackets the full generation.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from typing import Any, Callable, Sequence

import numpy as np

from jspec.bench.protocol import PARALLEL_METHODS, MethodSpec, RowResult
from jspec.decode import bucket
from jspec.generate import SpeculativeConfig, generate
from jspec.sampling import GREEDY, Sampling
from jspec.speculative.engines.pearl import DATA_AXIS as PAIR_AXIS, parse_role_mesh
from jspec.speculative.verify.consultant import LOSSLESS_RULES
from jspec.sharding import mesh_label, parse_mesh, replicate, shard_params

SPECULATIVE_FIELDS = tuple(f.name for f in dataclasses.fields(SpeculativeConfig))
TORCH_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                "float16": "float16", "fp16": "float16"}


def canonical_dtype(name: str) -> str:
    try:
        return TORCH_DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use float32, bfloat16 or float16") from None


def _row_trace(result: Any, field: str, b: int) -> list[int] | None:
    """Optional per-round trace [B, rounds] on a GenerationResult, cut to the row's rounds."""
    trace = getattr(result, field, None)
    if trace is None:
        return None
    n = int(np.asarray(result.rounds)[b]) if hasattr(result, "rounds") else np.asarray(trace).shape[1]
    return np.asarray(trace)[b, :n].astype(int).tolist()


def rows_from_generation(result: Any) -> list[RowResult]:
    """RowResults from a jspec.generate.GenerationResult (numpy fields, -1 after each row's end)."""
    rows = []
    for b in range(len(result.lengths)):
        n = int(result.lengths[b])
        rows.append(
            RowResult(
                new_tokens=np.asarray(result.tokens)[b, :n].astype(int).tolist(),
                target_calls=int(result.target_calls[b]),
                drafted=int(result.drafted[b]),
                accepted=int(result.accepted[b]),
                draft_lengths=_row_trace(result, "draft_lengths", b),
                step_tokens=_row_trace(result, "step_tokens", b),
                rolled_back=None if getattr(result, "rolled_back", None) is None else int(result.rolled_back[b]),
            )
        )
    return rows


class JspecMethod:
    """``jspec.generate.generate`` at one batch size and dtype; ``params`` are already cast."""

    def __init__(
        self,
        params: Any,
        cfg: Any,
        spec: MethodSpec,
        *,
        dtype: str,
        batch: int,
        max_new_tokens: int,
        generate_kwargs: dict[str, Any] | None = None,
        generate_fn: Callable[..., Any] | None = None,
        queue: bool = False,
        refill: int | None = None,
        sampling: Sampling = GREEDY,
        seed: int = 0,
    ):
        if spec.method not in ("ar", "spec") + PARALLEL_METHODS:
            raise ValueError(f"JspecMethod runs 'ar', 'spec' or {', '.join(PARALLEL_METHODS)}, not {spec.method!r}")
        self.params, self.cfg, self.spec = params, cfg, spec
        self.name, self.method = spec.name, spec.method
        self.drafter, self.policy, self.tree = spec.drafter, spec.policy, spec.tree
        self.dtype, self.batch, self.max_new_tokens = dtype, batch, max_new_tokens
        # queue: `batch` rows in flight over every prompt of a run (continuous batching), one call
        self.queue, self.refill = queue, refill
        # sampled runs: each batch draws with seed + a hash of its prompts, the same for every method
        self.sampling, self.seed = sampling, seed
        self._generate_fn = generate_fn
        self._kwargs = self._generate_kwargs(generate_kwargs or {})
        if spec.method in PARALLEL_METHODS:
            # device pairs (drafter, target); both models replicated on them once, here
            mesh = parse_role_mesh(self._kwargs.get("mesh"))
            self.mesh = "" if mesh is None else f"data={mesh.shape[PAIR_AXIS]},role=2"
            self.devices = 1 if mesh is None else mesh.size
            if mesh is not None:
                self.params = replicate(params, mesh)
                for key in ("drafter_params", "policy_params"):
                    if self._kwargs.get(key) is not None:
                        self._kwargs[key] = replicate(self._kwargs[key], mesh)
                self._kwargs["mesh"] = mesh
            return
        mesh = parse_mesh(self._kwargs.pop("mesh", None))
        self.mesh, self.devices = mesh_label(mesh), (1 if mesh is None else mesh.size)  # recorded in rows
        if mesh is not None:
            # Placed once here, so the timed calls find the weights already on the mesh.
            self.params = shard_params(params, mesh)
            if self._kwargs.get("drafter_params") is not None:
                self._kwargs["drafter_params"] = replicate(self._kwargs["drafter_params"], mesh)
            self._kwargs["mesh"] = mesh

    @property
    def verify_rule(self) -> str | None:
        """The rule that kept the drafts, for the rows: "greedy"; for sampled chains "block" (the
        default) or "token"; "tree" for sampled trees; "consultant" (lossy); a parallel engine's
        name; None for plain decoding."""
        if self.method == "ar":
            return None
        if self.method in PARALLEL_METHODS:
            return self.method
        verify = self._kwargs.get("verify", "lossless")
        if verify not in LOSSLESS_RULES:
            return "consultant"
        if self.sampling.greedy:
            return "greedy"
        return "tree" if self.tree else ("token" if verify == "token" else "block")

    def _generate(self) -> Callable[..., Any]:
        if self._generate_fn is None:
            self._generate_fn = generate
        return self._generate_fn

    def _generate_kwargs(self, extra: dict[str, Any]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, **extra}
        if self.method in PARALLEL_METHODS:
            from_spec = self.spec.generate_kwargs()
            kwargs.setdefault("drafter", from_spec.pop("drafter"))  # a built drafter may come in `extra`
            kwargs.update(from_spec)  # engine, gamma, and the spec's device pairs over the run-wide mesh
            return kwargs
        if self.method == "spec":
            from_spec = self.spec.generate_kwargs(default_k_max=extra.get("k_max") or 8)
            # A built drafter or a planned policy may come in `extra`; the spec's own options
            # (k=, tree shape, verify=) are this method's and win over the run-wide defaults.
            for key in ("drafter", "policy"):
                kwargs.setdefault(key, from_spec.pop(key))
            kwargs.update(from_spec)
        return kwargs

    def _call_kwargs(self) -> dict[str, Any]:
        """generate()'s keywords: the speculative settings grouped into one SpeculativeConfig."""
        kwargs = {k: v for k, v in self._kwargs.items() if k not in SPECULATIVE_FIELDS}
        fields = {k: v for k, v in self._kwargs.items() if k in SPECULATIVE_FIELDS and v is not None}
        if fields:
            kwargs["speculative"] = SpeculativeConfig(**fields)
        if self.queue:
            kwargs["batch_size"], kwargs["refill"] = self.batch, self.refill
        return kwargs

    def _warmup_batches(self, example_prompts: Sequence[Sequence[int]]) -> list[list[list[int]]]:
        """One batch per prompt-length bucket among the examples: generate compiles once per bucket,
        so warming each keeps every compile out of the timed region. Under `queue` the timed call
        is the whole prompt list, so that is the warm-up."""
        if self.queue:
            return [[list(p) for p in example_prompts]]
        by_bucket: dict[int, list[list[int]]] = {}
        for i in range(0, len(example_prompts), self.batch):
            group = [list(p) for p in example_prompts[i : i + self.batch]]
            by_bucket.setdefault(bucket(max(map(len, group))), group)
        return list(by_bucket.values())

    def _precision(self):
        """float32 runs use full-precision matmuls: GPUs would otherwise use TF32, and greedy
        identity between a K+1-token verify pass and 1-token AR steps needs real fp32."""
        import contextlib

        import jax

        return jax.default_matmul_precision("highest") if self.dtype == "float32" else contextlib.nullcontext()

    def _sampling_kwargs(self, prompts) -> dict[str, Any]:
        """generate()'s sampling and seed for this batch (greedy runs: none)."""
        if self.sampling.greedy:
            return {}
        return {"sampling": self.sampling, "seed": batch_seed(self.seed, prompts)}

    def prepare(self, example_prompts: Sequence[Sequence[int]]) -> float:
        start = time.perf_counter()
        with self._precision():
            for prompts in self._warmup_batches(example_prompts):
                self._generate()(self.params, self.cfg, prompts, **self._call_kwargs(), **self._sampling_kwargs(prompts))
        return time.perf_counter() - start

    def run(self, prompts: Sequence[Sequence[int]]) -> list[RowResult]:
        prompts = [list(p) for p in prompts]
        with self._precision():
            result = self._generate()(self.params, self.cfg, prompts, **self._call_kwargs(), **self._sampling_kwargs(prompts))
        return rows_from_generation(result)  # numpy fields: already on the host


def batch_seed(seed: int, prompts: Sequence[Sequence[int]]) -> int:
    """A batch's random seed: `seed` plus a hash of its prompts' token ids, so a sampled batch
    draws the same way in every run and for every method, whatever ran before it."""
    data = np.asarray([t for p in prompts for t in list(p) + [-1]], np.int64).tobytes()
    return (seed + zlib.crc32(data)) % (2**31)


def torch_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_hf_model(checkpoint: str, *, dtype: str, gguf_file: str | None = None, device: str | None = None):
    """The same checkpoint through transformers (a GGUF file is dequantised by transformers)."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": getattr(torch, canonical_dtype(dtype))}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    model = AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs)
    return model.to(device or torch_device()).eval()


class _ForwardCounter:
    """Counts the model's forward calls and the tokens fed to them (a forward pre-hook)."""

    def __init__(self, model):
        self.calls = 0
        self.fed_tokens = 0
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        self.calls += 1
        self.fed_tokens += int(ids.shape[1]) if ids is not None else 0

    def remove(self):
        self._handle.remove()


def cut_at_eos(tokens: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """Tokens up to and including the first EOS (jspec counts the EOS as a new token too)."""
    out = []
    for t in tokens:
        out.append(int(t))
        if t in eos_ids:
            break
    return out


class HFGenerateMethod:
    """transformers ``generate`` on the same model: greedy, left-padded batches, optionally
    prompt-lookup decoding (which transformers supports at batch 1 only)."""

    method = "hf"
    tree = False

    def __init__(
        self,
        model: Any,
        *,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        dtype: str,
        batch: int,
        max_new_tokens: int,
        prompt_lookup_num_tokens: int | None = None,
    ):
        if prompt_lookup_num_tokens and batch != 1:
            raise ValueError("transformers' prompt-lookup decoding only runs at batch 1")
        self.model, self.dtype, self.batch, self.max_new_tokens = model, dtype, batch, max_new_tokens
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.pad_token_id = int(pad_token_id)
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens
        self.drafter = "prompt_lookup" if prompt_lookup_num_tokens else None
        self.policy = f"static:{prompt_lookup_num_tokens}" if prompt_lookup_num_tokens else None
        self.name = MethodSpec("hf", drafter=self.drafter).name

    def _left_padded(self, prompts: Sequence[Sequence[int]]):
        import torch

        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
        device = self.model.device
        return ids.to(device), mask.to(device)

    def _generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        import torch

        ids, mask = self._left_padded(prompts)
        kwargs: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, top_p=None, top_k=None,
            temperature=None, eos_token_id=self.eos_token_ids or None, pad_token_id=self.pad_token_id,
        )
        if self.prompt_lookup_num_tokens:
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup_num_tokens
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        new = out[:, ids.shape[1]:].tolist()  # .tolist() waits for the device
        return [cut_at_eos(row, self.eos_token_ids) for row in new]

    def prepare(self, example_prompts: Sequence[Sequence[int]]) -> float:
        """A short untimed generation: CUDA context, kernels and allocator warm-up."""
        start = time.perf_counter()
        self._generate(list(example_prompts[: self.batch]), min(8, self.max_new_tokens))
        return time.perf_counter() - start

    def run(self, prompts: Sequence[Sequence[int]]) -> list[RowResult]:
        counter = _ForwardCounter(self.model)
        try:
            outputs = self._generate(prompts, self.max_new_tokens)
        finally:
            counter.remove()
        if not self.prompt_lookup_num_tokens:
            # plain greedy: the prefill yields the first token, each later forward one more
            return [RowResult(new_tokens=o, target_calls=len(o)) for o in outputs]
        return [self._prompt_lookup_row(outputs[0], len(prompts[0]), counter)]

    @staticmethod
    def _prompt_lookup_row(new_tokens: list[int], prompt_len: int, counter: _ForwardCounter) -> RowResult:
        """Batch-1 assisted decoding: each verification forward is fed the not-yet-cached token
        plus the candidates (the first forward: the prompt plus candidates), and emits the accepted
        candidates plus one target token."""
        drafted = max(counter.fed_tokens - prompt_len - (counter.calls - 1), 0)
        accepted = min(max(len(new_tokens) - counter.calls, 0), drafted)
        return RowResult(new_tokens=new_tokens, target_calls=counter.calls, drafted=drafted, accepted=accepted)

    def reset_peak_memory(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def peak_memory_bytes(self) -> int | None:
        import torch

        return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None
