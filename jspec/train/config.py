"""Training settings and recipe files.

`TrainConfig` holds everything that changes the math of a train step; it is frozen and hashable
because the jitted step takes it as a static argument. `DataConfig` (self-distillation) and
`RunConfig` (checkpoints, logging, mesh) never enter the step. A recipe is a JSON file under
`training/` with one object per section:

    {"description": "...",
     "head":  {"kind": "eagle3", "draft_vocab_size": 32000, "capture_layers": null, "intermediate_size": null,
               "lm_head_init": "target"},
     "data":  {DataConfig fields},
     "train": {TrainConfig fields except kind / draft vocab, which come from "head"},
     "run":   {RunConfig fields}}
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from ..errors import UsageError
from .shards import LoopCut, check_length_buckets


@dataclass(frozen=True)
class TrainConfig:
    kind: str = "eagle3"
    # training-time test: draft steps unrolled per sequence, step j weighted decay**j
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    # EAGLE-1 loss: regression_weight * SmoothL1(features) + ce_weight * soft CE (§1.1)
    regression_weight: float = 1.0
    ce_weight: float = 0.1
    # [I] the acceptance term next to the CE (losses module doc): weight * (1 - sum min(p, q)) at
    # acceptance_temperature, for heads that serve sampling (T = 0.7-1); 0: the CE alone
    acceptance_weight: float = 0.0
    acceptance_temperature: float = 1.0
    # uniform noise (U(0,1) - 0.5) * std * 512 / row_length on the first step's input features
    feature_noise_std: float = 0.0
    # optimisation. lr, warm-up, clipping and noise differ from EAGLE's reference recipes (lr 3e-5 /
    # 5e-5, clip 0.5, thousands of warm-up steps, EAGLE-1 noise 0.2) on purpose: those train for
    # 20-40 epochs, jspec's recipes for ~15 minutes; docs/methods.md §2.2 gives the reasons.
    batch_size: int = 32  # global, over all hosts and devices
    seq_len: int = 1024
    steps: int = 2000
    lr: float = 6e-4
    warmup_steps: int = 100
    warmup_ratio: float = 0.0  # > 0: warm-up is this share of the run's total steps (overrides warmup_steps)
    final_lr_fraction: float = 0.1  # cosine decays to lr * this
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0  # global norm
    compute_dtype: str = "bfloat16"  # params are kept in float32 (master weights)
    remat: bool = True  # recompute each TTT step in the backward pass (logits dominate memory)
    logits_chunk: int = 256  # positions per chunk of the target's full-vocab argmax
    seed: int = 0
    # responses that turn into loops are cut loop_cut_keep tokens after the loop starts (a run of
    # loop_cut_run positions whose loop_cut_ngram-gram occurred before; jspec.train.shards.LoopCut)
    loop_cut_ngram: int = 8
    loop_cut_run: int = 32  # 0: keep loops whole
    loop_cut_keep: int = 64
    # pad each batch only to the smallest of these lengths that holds its longest row (rows sorted
    # by length within windows; jspec.train.data.ShardedLoader); () = always seq_len. Must end at seq_len.
    length_buckets: tuple[int, ...] = ()
    # several distilled rows per training row, each attending within itself only (segment ids;
    # jspec.train.data.ShardedLoader); rows are then always seq_len long and length_buckets must be ()
    pack_documents: bool = False

    @property
    def loop_cut(self) -> LoopCut:
        return LoopCut(self.loop_cut_ngram, self.loop_cut_run, self.loop_cut_keep)

    def __post_init__(self):
        if self.ttt_steps < 1:
            raise ValueError("ttt_steps must be >= 1")
        if self.acceptance_weight < 0 or self.acceptance_temperature <= 0:
            raise ValueError(f"acceptance_weight must be >= 0 and acceptance_temperature > 0, got "
                             f"{self.acceptance_weight} and {self.acceptance_temperature}")
        if self.seq_len <= self.ttt_steps + 1:
            raise ValueError("seq_len must exceed ttt_steps + 1")
        check_length_buckets(self.length_buckets, self.seq_len)
        if self.pack_documents and self.length_buckets:
            raise ValueError("pack_documents fills every row to seq_len: length_buckets must be [] with it")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")


@dataclass(frozen=True)
class DataConfig:
    num_prompts: int = 4000  # chitchat prompts (jspec.tasks.training_prompts)
    self_prompts: int = 0  # extra prompts the target writes itself (topic x style instructions)
    self_prompt_samples: int = 1  # prompts written per instruction (> 1: sampled, for variety)
    self_prompt_temperature: float = 1.0
    max_new_tokens: int = 512  # response length cap when the target answers
    gen_batch_size: int = 64
    rows_per_shard: int = 1024
    prompt_seed: int = 0
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template when it has one


@dataclass(frozen=True)
class RunConfig:
    ckpt_every: int = 250
    ckpt_every_s: float = 0.0  # also checkpoint when this many seconds passed since the last one (0: off)
    keep_checkpoints: int = 3
    log_every: int = 10
    # held-out metrics (the dataset's "holdout" shards) every eval_every steps, eval_batches global
    # batches each, to holdout_metrics.jsonl: training accuracy alone hides memorisation (0 = off)
    eval_every: int = 0
    eval_batches: int = 4
    fsdp: int = 1  # devices per fsdp group; the rest of the devices form the data axis
    export_dtype: str = "bfloat16"
    # the exported head in files of at most this many MiB (Hugging Face shards with their index;
    # 0: one file). A head shipped in a repository keeps each file small.
    export_max_file_mb: float = 0.0


@dataclass(frozen=True)
class HeadSpec:
    kind: str = "eagle3"
    draft_vocab_size: int = 0
    capture_layers: tuple[int, ...] | None = None  # None = EAGLE-3 default (2, L//2, L-3)
    intermediate_size: int | None = None
    # EAGLE-3's own LM head: "target" = the target's output-embedding rows of the draft vocabulary
    # (through d2t) and the target's final norm, "random" = N(0, 0.02^2) and ones
    lm_head_init: str = "random"
    # EAGLE-3's captured layer inputs reach the fc as they are ("none", the published head), or
    # multiplied by a fixed power of two per layer measured on the first batch so each has token
    # RMS near one ("rms"; exports fold it into fc). Gemma-3's residual stream has token RMS in the
    # hundreds: unscaled, the fused feature dwarfs what the head's layer adds to it, and Adam's
    # per-weight steps move the fc's output ~40x faster than on SmolLM2.
    input_scale: str = "none"
    # EAGLE-3.1 (SpecForge / vLLM): a learned RMSNorm on each captured layer before the fc
    # (`fc_norm`), and the post-final-norm hidden fed back at later draft steps (`norm_output`).
    # Off: the published EAGLE-3 head SGLang also serves.
    fc_norm: bool = False
    norm_output: bool = False

    def __post_init__(self):
        if (self.fc_norm or self.norm_output) and self.kind != "eagle3":
            raise ValueError("head.fc_norm / head.norm_output are EAGLE-3.1 options of eagle3 heads")
        if self.lm_head_init not in ("random", "target"):
            raise ValueError(f"head.lm_head_init must be 'random' or 'target', got {self.lm_head_init!r}")
        if self.input_scale not in ("none", "rms"):
            raise ValueError(f"head.input_scale must be 'none' or 'rms', got {self.input_scale!r}")
        if self.input_scale == "rms" and self.kind != "eagle3":
            raise ValueError("head.input_scale 'rms' applies to eagle3 heads (EAGLE-1 reads the normed final hidden)")


@dataclass(frozen=True)
class Recipe:
    head: HeadSpec = field(default_factory=HeadSpec)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    description: str = ""


def _build(cls, d: dict):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields in recipe: {sorted(unknown)}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def recipe_from_dict(d: dict) -> Recipe:
    head = _build(HeadSpec, d.get("head", {}))
    train = _build(TrainConfig, {"kind": head.kind, **d.get("train", {})})
    if train.kind != head.kind:
        raise ValueError(f"train.kind {train.kind!r} disagrees with head.kind {head.kind!r}")
    return Recipe(
        head=head,
        data=_build(DataConfig, d.get("data", {})),
        train=train,
        run=_build(RunConfig, d.get("run", {})),
        description=d.get("description", ""),
    )


def recipe_json(path: str) -> dict:
    """A recipe file's JSON object; UsageError (one line) when there is none or it is not JSON."""
    if not os.path.isfile(path):
        raise UsageError(f"no recipe at {path} (the shipped recipes are training/*.json)")
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"recipe {path} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise UsageError(f"recipe {path} must hold one JSON object (sections head, data, train, run, distill)")
    return data


def load_recipe(path: str) -> Recipe:
    return recipe_from_dict(recipe_json(path))


def recipe_to_dict(r: Recipe) -> dict:
    return {
        "description": r.description,
        "head": dataclasses.asdict(r.head),
        "data": dataclasses.asdict(r.data),
        "train": dataclasses.asdict(r.train),
        "run": dataclasses.asdict(r.run),
    }
