"""Self-distillation data: the target answers prompts, the head learns the target's own outputs.

On-disk format (one directory):

    meta.json          {"format": "jspec-distill-v1", "seq_len": T, "pad_id": int, "vocab_size": V,
                        "shards": [{"file": "shard-00000.npz", "rows": n}, ...], ...provenance}
    shard-00000.npz    tokens    [n, T] int32  prompt + response, right-padded with pad_id
                       loss_mask [n, T] bool   True on response tokens (the target's own output,
                                               EOS included), False on prompt and padding
                       lengths   [n]    int32  valid (non-pad) tokens per row

Only token ids are stored: target features and logits are recomputed online by the frozen target
inside the train step, so the data stays small and independent of the feature layout.

Loading is per host and deterministic in (seed, step): for epoch e the shards are permuted with
seed (seed, e) and dealt round-robin to the processes (each host opens only its own shards); a
host shuffles its rows with seed (seed, e, host) and cuts them into local batches. Batch `step`
is therefore a pure function of the step number, which is all a checkpoint needs to resume the
data stream exactly. With fewer shards than processes every host reads every shard and keeps
every P-th row instead.

Length buckets (`length_buckets`, e.g. (256, 384, 512, 768)): a batch padded to the longest row
of the dataset is mostly padding when answers vary from 10 to 700 tokens (58% of the first
corpus run's batches). With buckets, a host sorts its shuffled rows by length within windows of
`bucket_window` batches, cuts the windows into batches, shuffles the batch order, and pads each
batch only to the smallest bucket that holds its longest row (the largest over hosts: one tiny
all-gather per step when there are several). The train step compiles once per bucket. Still a
pure function of (seed, step).

Packed rows (`pack_documents`): instead, a host packs its shuffled rows ("documents") into
training rows of seq_len tokens, several per row, by first-fit decreasing within windows of
`bucket_window` batches of documents (`shards.plan_packing`), shuffles the packed rows and cuts
them into batches. Every batch has seq_len columns (one compiled step) and `segment_ids` number
each row's documents 1, 2, ... (0 on the padding left at the end), which the train step turns
into per-document attention masks and positions. An epoch has as many steps as the host with the
fewest packed rows can fill; every host computes every host's packing (from row lengths alone),
so they agree without communicating. Still a pure function of (seed, step).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
from jax.experimental import multihost_utils

from . import shards as shards_v2

from .. import tasks
from ..generate import generate
from ..sampling import Sampling
from ..tokenizer import has_chat_template, prompt_ids

FORMAT = "jspec-distill-v1"
META_FILE = "meta.json"


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def pack_example(prompt: Sequence[int], response: Sequence[int], seq_len: int, pad_id: int):
    """(tokens [T], loss_mask [T], length) for prompt + response, truncated to seq_len."""
    ids = (list(prompt) + list(response))[:seq_len]
    tokens = np.full((seq_len,), pad_id, np.int32)
    mask = np.zeros((seq_len,), bool)
    tokens[: len(ids)] = ids
    mask[len(prompt) : len(ids)] = True
    return tokens, mask, len(ids)


class ShardWriter:
    """Accumulates packed rows and writes them as fixed-size shards plus meta.json on close."""

    def __init__(self, out_dir: str, seq_len: int, pad_id: int, vocab_size: int, rows_per_shard: int = 1024):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.seq_len, self.pad_id = out_dir, seq_len, pad_id
        self.vocab_size, self.rows_per_shard = vocab_size, rows_per_shard
        self._rows: list[tuple[np.ndarray, np.ndarray, int]] = []
        self.shards: list[dict] = []

    def add(self, prompt: Sequence[int], response: Sequence[int]) -> None:
        self._rows.append(pack_example(prompt, response, self.seq_len, self.pad_id))
        if len(self._rows) == self.rows_per_shard:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        name = f"shard-{len(self.shards):05d}.npz"
        tokens, mask, lengths = zip(*self._rows)
        np.savez(
            os.path.join(self.out_dir, name),
            tokens=np.stack(tokens), loss_mask=np.stack(mask), lengths=np.asarray(lengths, np.int32),
        )
        self.shards.append({"file": name, "rows": len(self._rows)})
        self._rows = []

    def close(self, **provenance) -> dict:
        self._flush()
        meta = {
            "format": FORMAT, "seq_len": self.seq_len, "pad_id": self.pad_id,
            "vocab_size": self.vocab_size, "shards": self.shards, **provenance,
        }
        with open(os.path.join(self.out_dir, META_FILE), "w") as fh:
            json.dump(meta, fh, indent=1)
        return meta


def write_dataset(out_dir: str, examples: Iterable[tuple[Sequence[int], Sequence[int]]], *, seq_len: int,
                  pad_id: int, vocab_size: int, rows_per_shard: int = 1024, **provenance) -> dict:
    """Write (prompt ids, response ids) pairs; returns meta."""
    w = ShardWriter(out_dir, seq_len, pad_id, vocab_size, rows_per_shard)
    for prompt, response in examples:
        w.add(prompt, response)
    return w.close(**provenance)


def read_meta(data_dir: str) -> dict:
    """meta.json of a jspec-distill-v1 (fixed-length rows) or -v2 (jspec.train.shards) dataset."""
    meta = shards_v2.read_meta(data_dir)
    if meta.get("format") not in (FORMAT, shards_v2.FORMAT):
        raise ValueError(f"{data_dir}: not a {FORMAT} or {shards_v2.FORMAT} dataset")
    return meta


def load_shard(data_dir: str, name: str) -> dict[str, np.ndarray]:
    with np.load(os.path.join(data_dir, name)) as z:
        return {k: z[k] for k in ("tokens", "loss_mask", "lengths")}


def token_counts(data_dir: str, vocab_size: int) -> np.ndarray:
    """How often each target token occurs as a response token (of the training split): picks
    EAGLE-3's draft vocab."""
    if read_meta(data_dir)["format"] == shards_v2.FORMAT:
        return shards_v2.response_token_counts(data_dir, vocab_size, "train")
    counts = np.zeros((vocab_size,), np.int64)
    for shard in read_meta(data_dir)["shards"]:
        s = load_shard(data_dir, shard["file"])
        counts += np.bincount(s["tokens"][s["loss_mask"]], minlength=vocab_size)[:vocab_size]
    return counts


# ---------------------------------------------------------------------------------------------
# Deterministic per-host loading
# ---------------------------------------------------------------------------------------------


@dataclass
class ShardedLoader:
    """Local batches of a global batch, a pure function of (seed, step).

    v2 datasets (variable-length rows) are packed to `seq_len` as shards load: prompt + response
    cut at seq_len (counted by `shards.length_stats`), loss on response tokens; only the `split`
    shards are read ("train" by default, "holdout" for held-out evaluation).
    """

    data_dir: str
    global_batch: int
    seed: int = 0
    process_index: int = 0
    process_count: int = 1
    seq_len_override: int | None = None  # required for v2 datasets
    split: str = "train"
    loop_cut: shards_v2.LoopCut = shards_v2.NO_LOOP_CUT  # v2 rows: where looping responses are cut
    length_buckets: tuple[int, ...] = ()  # () = every batch padded to seq_len (see the module doc)
    bucket_window: int = 32  # batches per length-sorting (or document-packing) window
    pack_documents: bool = False  # several rows per training row (see the module doc)

    def __post_init__(self):
        if self.global_batch % self.process_count:
            raise ValueError("global batch must divide evenly over processes")
        self.meta = read_meta(self.data_dir)
        self._v2 = self.meta["format"] == shards_v2.FORMAT
        if self._v2:
            if not self.seq_len_override:
                raise ValueError(f"{self.data_dir} holds variable-length rows: pass seq_len_override")
            self._files = shards_v2.shard_files(self.meta, self.split)
        else:
            self._files = self.meta["shards"]
        if not self._files:
            raise ValueError(f"{self.data_dir}: no {self.split} shards")
        self.local_batch = self.global_batch // self.process_count
        self._rows_per_shard = [s["rows"] for s in self._files]
        self._by_shard = len(self._rows_per_shard) >= self.process_count
        self._cache: dict[str, dict[str, np.ndarray]] = {}
        self._epoch_rows: dict[int, np.ndarray] = {}
        self._lengths: dict[int, np.ndarray] = {}  # shard index -> its rows' lengths (packing plans)
        self._plans: dict[tuple[int, int], list[np.ndarray]] = {}  # (epoch, host) -> packed rows
        self._steps: dict[int, int] = {}
        if self.pack_documents and self.length_buckets:
            raise ValueError("pack_documents fills every row to seq_len: length_buckets must be () with it")
        if self.steps_in_epoch(0) == 0:
            raise ValueError(f"{self.data_dir}: too few rows for a local batch of {self.local_batch}")
        shards_v2.check_length_buckets(self.length_buckets, self.seq_len)

    @property
    def seq_len(self) -> int:
        return self.seq_len_override if self._v2 else self.meta["seq_len"]

    def _assignment(self, epoch: int, host: int) -> list[tuple[int, int]]:
        """(shard, row) pairs owned by `host` in `epoch`, before shuffling."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self._rows_per_shard))
        if self._by_shard:
            return [(s, r) for s in order[host :: self.process_count] for r in range(self._rows_per_shard[s])]
        every = [(s, r) for s in order for r in range(self._rows_per_shard[s])]
        return every[host :: self.process_count]

    def steps_in_epoch(self, epoch: int) -> int:
        """Equal on every host: the host with the fewest rows (packed rows) bounds the epoch."""
        if self.pack_documents:
            if epoch not in self._steps:
                self._steps[epoch] = min(len(self._packed(epoch, h)) for h in range(self.process_count)) // self.local_batch
            return self._steps[epoch]
        if self._by_shard:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self._rows_per_shard))
            rows = [sum(self._rows_per_shard[s] for s in order[h :: self.process_count]) for h in range(self.process_count)]
        else:
            total = sum(self._rows_per_shard)
            rows = [len(range(h, total, self.process_count)) for h in range(self.process_count)]
        return min(rows) // self.local_batch

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, batch index within the epoch) of a global step."""
        epoch = 0
        while step >= (n := self.steps_in_epoch(epoch)):
            step -= n
            epoch += 1
        return epoch, step

    def _shuffled(self, epoch: int, host: int) -> np.ndarray:
        """[n, 2] (shard, row) pairs of `host` in `epoch`, shuffled."""
        pairs = np.asarray(self._assignment(epoch, host), np.int64).reshape(-1, 2)
        return pairs[np.random.default_rng([self.seed, epoch, host]).permutation(len(pairs))]

    def _packed(self, epoch: int, host: int) -> list[np.ndarray]:
        """`host`'s packed rows of `epoch`, in batch order: each an [k, 2] array of (shard, row)."""
        if (epoch, host) not in self._plans:
            if len(self._plans) >= 2 * self.process_count:  # about one epoch's plans in memory
                self._plans.pop(next(iter(self._plans)))
            pairs = self._shuffled(epoch, host)
            lengths = np.asarray([self._row_lengths(int(s))[int(r)] for s, r in pairs], np.int64)
            rows = shards_v2.plan_packing(lengths, self.seq_len, self.bucket_window * self.local_batch)
            order = np.random.default_rng([self.seed, epoch, host, 2]).permutation(len(rows))
            self._plans[(epoch, host)] = [pairs[rows[i]] for i in order]
        return self._plans[(epoch, host)]

    def _row_lengths(self, index: int) -> np.ndarray:
        if index not in self._lengths:
            self._lengths[index] = self._shard(index)["lengths"]
        return self._lengths[index]

    def _rows(self, epoch: int) -> np.ndarray:
        if epoch not in self._epoch_rows:
            pairs = self._shuffled(epoch, self.process_index)
            if self.length_buckets:
                pairs = self._length_grouped(epoch, pairs)
            self._epoch_rows = {epoch: pairs}  # keep one epoch's order in memory
        return self._epoch_rows[epoch]

    def _length_grouped(self, epoch: int, pairs: np.ndarray) -> np.ndarray:
        """The epoch's rows reordered so each batch holds rows of similar length (module doc)."""
        b = self.local_batch
        n = self.steps_in_epoch(epoch) * b  # the rows this epoch's batches use, as without buckets
        used, rest = pairs[:n], pairs[n:]
        lengths = np.asarray([self._shard(int(s))["lengths"][int(r)] for s, r in used])
        window = self.bucket_window * b
        order = np.concatenate([start + np.argsort(lengths[start : start + window], kind="stable")
                                for start in range(0, n, window)])
        batches = used[order].reshape(-1, b, 2)
        shuffled = np.random.default_rng([self.seed, epoch, self.process_index, 1]).permutation(len(batches))
        return np.concatenate([batches[shuffled].reshape(-1, 2), rest])

    def _bucket(self, longest: int) -> int:
        if self.process_count > 1:  # every host pads the step's batch to the same length
            longest = int(np.max(multihost_utils.process_allgather(np.int32(longest))))
        return next(t for t in self.length_buckets if t >= longest)

    def _shard(self, index: int) -> dict[str, np.ndarray]:
        name = self._files[index]["file"]
        if name not in self._cache:
            if len(self._cache) >= 64:  # bounded: a host streams through its shards
                self._cache.pop(next(iter(self._cache)))
            if self._v2:
                rows = shards_v2.load_rows(self.data_dir, name)
                kept = shards_v2.response_keep(self.data_dir, name, rows, self.loop_cut)
                tokens, mask, lengths = shards_v2.pack_rows(rows, self.seq_len, self.meta["pad_id"],
                                                            loop_cut=self.loop_cut, kept=kept)
                self._cache[name] = {"tokens": tokens, "loss_mask": mask, "lengths": lengths}
            else:
                self._cache[name] = load_shard(self.data_dir, name)
        return self._cache[name]

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This host's rows of global batch `step`: tokens [b, T] int32, loss_mask [b, T] bool,
        segment_ids [b, T] int32 (documents 1, 2, ... of a row; 0 on padding), lengths [b] int32
        (non-padding tokens of each row)."""
        epoch, i = self.locate(step)
        if self.pack_documents:
            rows = self._packed(epoch, self.process_index)
            return self._packed_batch(rows[i * self.local_batch : (i + 1) * self.local_batch])
        pairs = self._rows(epoch)[i * self.local_batch : (i + 1) * self.local_batch]
        rows = [{k: v[r] for k, v in self._shard(s).items()} for s, r in pairs]
        batch = {k: np.stack([row[k] for row in rows]) for k in ("tokens", "loss_mask", "lengths")}
        if self.length_buckets:
            T = self._bucket(int(batch["lengths"].max()))
            batch["tokens"], batch["loss_mask"] = batch["tokens"][:, :T], batch["loss_mask"][:, :T]
        T = batch["tokens"].shape[1]
        batch["segment_ids"] = (np.arange(T)[None] < batch["lengths"][:, None]).astype(np.int32)
        return batch

    def _packed_batch(self, rows: list[np.ndarray]) -> dict[str, np.ndarray]:
        b, T = len(rows), self.seq_len
        batch = {"tokens": np.full((b, T), self.meta["pad_id"], np.int32), "loss_mask": np.zeros((b, T), bool),
                 "segment_ids": np.zeros((b, T), np.int32), "lengths": np.zeros((b,), np.int32)}
        for i, docs in enumerate(rows):
            at = 0
            for doc, (s, r) in enumerate(docs, 1):
                shard = self._shard(int(s))
                n = int(shard["lengths"][r])
                batch["tokens"][i, at : at + n] = shard["tokens"][r, :n]
                batch["loss_mask"][i, at : at + n] = shard["loss_mask"][r, :n]
                batch["segment_ids"][i, at : at + n] = doc
                at += n
            batch["lengths"][i] = at
        return batch


# ---------------------------------------------------------------------------------------------
# Self-distillation (the target answers prompts)
# ---------------------------------------------------------------------------------------------

# Topics and styles for prompts the target writes itself: greedy decoding of distinct
# instructions gives distinct questions without depending on a sampler.
_TOPICS = (
    "cooking", "travel", "personal finance", "history", "physics", "biology", "chemistry",
    "astronomy", "programming in Python", "web development", "databases", "mathematics",
    "statistics", "music", "movies", "books", "sports", "fitness", "nutrition", "sleep",
    "gardening", "pets", "parenting", "careers", "job interviews", "writing", "poetry",
    "philosophy", "psychology", "economics", "climate", "geography", "languages", "art",
    "photography", "video games", "cars", "home repair", "electronics", "law", "medicine",
    "productivity", "relationships", "friendship", "holidays", "fashion", "architecture",
    "machine learning", "the internet", "space exploration",
)
_STYLES = (
    "a short factual question", "a request for advice", "a request to explain a concept simply",
    "a request for a list of ideas", "a how-to question",
)


def self_prompt_instructions(n: int, seed: int = 0) -> list[str]:
    """n distinct instructions asking the target to write one user prompt each."""
    combos = [(t, s) for t in _TOPICS for s in _STYLES]
    order = np.random.default_rng(seed).permutation(len(combos))
    if n > len(combos):
        raise ValueError(f"at most {len(combos)} self-written prompts are available")
    return [
        f"Write {combos[i][1]} that a user might ask an AI assistant about {combos[i][0]}. "
        "Reply with the user's message only."
        for i in order[:n]
    ]


def encode_prompt(tokenizer, text: str, chat_template: bool = True) -> list[int]:
    """Token ids of a user turn, through the tokenizer's chat template when it has one."""
    return prompt_ids(tokenizer, text, chat=chat_template and has_chat_template(tokenizer))


def clean_written_prompt(text: str) -> str:
    """First non-empty line of the target's answer, without quotes or a 'User:' label."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    for label in ("User:", "user:", "Question:", "Prompt:"):
        line = line.removeprefix(label).strip()
    return line.strip('"').strip()


def answer_prompts(generate_fn: Callable, prompts: list[list[int]], *, max_new_tokens: int,
                   batch_size: int, progress: bool = True, **gen_kwargs) -> list[list[int]]:
    """The target's responses (EOS included) to token-id prompts, batched by similar length."""
    from tqdm import tqdm

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    responses: list[list[int]] = [[] for _ in prompts]
    for start in tqdm(range(0, len(order), batch_size), desc="distill", disable=not progress):
        idx = order[start : start + batch_size]
        res = generate_fn([prompts[i] for i in idx], max_new_tokens=max_new_tokens, **gen_kwargs)
        for row, i in enumerate(idx):
            responses[i] = [int(t) for t in res.tokens[row, : res.lengths[row]]]
    return responses


def distill_dataset(target_params, target_cfg, tokenizer, out_dir: str, *, data_cfg, seq_len: int,
                    progress: bool = True) -> dict:
    """Build a self-distillation dataset: prompts (chitchat + optional self-written) answered by
    the target with greedy decoding, packed into shards. Returns meta."""
    def gen(prompts, max_new_tokens, sampling=None, seed=0):
        return generate(target_params, target_cfg, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed)

    texts = list(tasks.training_prompts(data_cfg.num_prompts, data_cfg.prompt_seed))
    if data_cfg.self_prompts:
        instructions = self_prompt_instructions(data_cfg.self_prompts, data_cfg.prompt_seed)
        ids = [encode_prompt(tokenizer, t, data_cfg.chat_template) for t in instructions]
        n = data_cfg.self_prompt_samples
        sampling = Sampling(temperature=data_cfg.self_prompt_temperature) if n > 1 else None
        written = answer_prompts(gen, ids * n, max_new_tokens=64, batch_size=data_cfg.gen_batch_size,
                                 progress=progress, sampling=sampling, seed=data_cfg.prompt_seed)
        cleaned = (clean_written_prompt(tokenizer.decode(r, skip_special_tokens=True)) for r in written)
        texts += list(dict.fromkeys(p for p in cleaned if p))  # distinct, in order
    max_prompt = seq_len - 16  # leave room for a response worth learning from
    prompts = [p for p in (encode_prompt(tokenizer, t, data_cfg.chat_template) for t in texts) if len(p) <= max_prompt]
    max_new = min(data_cfg.max_new_tokens, seq_len)
    responses = answer_prompts(gen, prompts, max_new_tokens=max_new, batch_size=data_cfg.gen_batch_size, progress=progress)
    return write_dataset(
        out_dir, zip(prompts, responses), seq_len=seq_len, pad_id=target_cfg.pad_token_id,
        vocab_size=target_cfg.vocab_size, rows_per_shard=data_cfg.rows_per_shard,
        num_prompts=len(prompts), self_prompts=data_cfg.self_prompts, max_new_tokens=max_new,
        prompt_seed=data_cfg.prompt_seed,
    )
