"""The distilled-data format written on the device: variable-length rows, compact and resumable.

Directory (FORMAT "jspec-distill-v2"):

    meta.json        {"format", "vocab_size", "pad_id", "eos_token_ids", "token_dtype",
                      "sources": [names], "shards": [{"file", "rows", "response_tokens", "split"}],
                      "eval_shards": [...same...], ...provenance}
    shard-00000.npz  np.savez_compressed:
                       tokens       [N]     uint16 (uint32 for vocabularies over 65,536 ids):
                                            prompt + response of every row, concatenated
                       offsets      [n + 1] int64
                       prompt_lens  [n]     int32  the response starts there
                       items        [n]     int32  which prompt (corpus index, or the self-written /
                                                   evaluation numbering of meta["item_spaces"])
                       source       [n]     uint8  index into meta["sources"]
                       temperature  [n]     float16 0 = greedy
                       ended        [n]     bool   the response ends with EOS (not cut at max_new)
    eval-00000.npz   the same layout: reference answers to evaluation prompts (never trained on)

Writes are atomic (a shard is written under a temporary name, then renamed; meta.json likewise),
so a killed writer leaves a readable dataset and a resumed one appends shard numbers after the
last one listed. One shard in every `holdout_every` is "holdout" (numbers every//2, every//2 +
every, ...: the first comes after every//2 shards), for the LDLP predictor and held-out metrics;
the rest is "train".

Training reads rows through `pack_rows`: prompt + response cut to the training sequence length
(counted, never silent: `PackStats`), right-padded, loss on response tokens. A response that
degenerates into a loop (a small target answering chit-chat greedily for 512 tokens repeats one
sentence for hundreds of them) is cut 64 tokens after the loop starts (`LoopCut`, also counted):
without the cut, looping text was over half of the training tokens, trivially predictable, and a
head trained on it scored 0.65-0.79 top-1 in training but 0.35 on MT-Bench answers.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field

import numpy as np

from ..errors import UsageError

FORMAT = "jspec-distill-v2"
META_FILE = "meta.json"


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 65536 else np.uint32


def _atomic_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)


def read_meta(data_dir: str) -> dict:
    """The dataset's meta.json; UsageError (one line) when `data_dir` holds no distilled dataset."""
    path = os.path.join(data_dir, META_FILE)
    if not os.path.isfile(path):
        raise UsageError(f"{data_dir}: no distilled dataset there (no {META_FILE}; `jspec distill` writes one)")
    with open(path) as fh:
        return json.load(fh)


def require_dataset(data_dir: str) -> None:
    """What a trainer checks before it loads a model: `data_dir` holds a distilled dataset."""
    read_meta(data_dir)


def load_rows(data_dir: str, name: str) -> dict[str, np.ndarray]:
    with np.load(os.path.join(data_dir, name)) as z:
        return {k: z[k] for k in z.files}


def row_tokens(rows: dict[str, np.ndarray], r: int) -> np.ndarray:
    return rows["tokens"][rows["offsets"][r] : rows["offsets"][r + 1]]


class RowWriter:
    """Appends distilled rows to a v2 directory; resumable (see module doc)."""

    def __init__(self, out_dir: str, *, vocab_size: int, pad_id: int, eos_token_ids, sources: list[str],
                 rows_per_shard: int = 2048, holdout_every: int = 25, provenance: dict | None = None):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.rows_per_shard, self.holdout_every = out_dir, rows_per_shard, holdout_every
        self.dtype = token_dtype(vocab_size)
        if os.path.isfile(os.path.join(out_dir, META_FILE)):
            self.meta = read_meta(out_dir)
            if self.meta.get("format") != FORMAT:
                raise ValueError(f"{out_dir} holds a {self.meta.get('format')} dataset, not {FORMAT}")
            if self.meta["vocab_size"] != vocab_size or self.meta["sources"] != list(sources):
                raise ValueError(f"{out_dir} was written for another target or corpus (vocab / sources differ)")
        else:
            self.meta = {"format": FORMAT, "vocab_size": int(vocab_size), "pad_id": int(pad_id),
                         "eos_token_ids": [int(t) for t in eos_token_ids], "token_dtype": np.dtype(self.dtype).name,
                         "sources": list(sources), "shards": [], "eval_shards": []}
        self.meta.update(provenance or {})
        self._pending: dict[str, list] = {"train": [], "eval": []}

    # ---- what is already there -------------------------------------------------------------
    def done_items(self, which: str = "shards") -> set[int]:
        done: set[int] = set()
        for s in self.meta[which]:
            with np.load(os.path.join(self.out_dir, s["file"])) as z:
                done.update(int(i) for i in z["items"])
        return done

    # ---- appending ----------------------------------------------------------------------------
    def add(self, prompt, response, *, item: int, source: int, temperature: float, ended: bool,
            split: str = "train") -> None:
        self._pending[split].append((np.asarray(prompt), np.asarray(response), item, source, temperature, ended))
        if len(self._pending[split]) >= self.rows_per_shard:
            self.flush(split)

    def flush(self, split: str | None = None) -> None:
        for sp in ([split] if split else list(self._pending)):
            rows = self._pending[sp]
            if not rows:
                continue
            key = "eval_shards" if sp == "eval" else "shards"
            prefix = "eval" if sp == "eval" else "shard"
            index = len(self.meta[key])
            name = f"{prefix}-{index:05d}.npz"
            seqs = [np.concatenate([p, r]).astype(self.dtype) for p, r, *_ in rows]
            lengths = np.asarray([len(s) for s in seqs], np.int64)
            arrays = {
                "tokens": np.concatenate(seqs) if seqs else np.zeros((0,), self.dtype),
                "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                "prompt_lens": np.asarray([len(p) for p, *_ in rows], np.int32),
                "items": np.asarray([it for _, _, it, *_ in rows], np.int32),
                "source": np.asarray([s for *_, s, _, _ in rows], np.uint8),
                "temperature": np.asarray([t for *_, t, _ in rows], np.float16),
                "ended": np.asarray([e for *_, e in rows], bool),
            }
            tmp = os.path.join(self.out_dir, name + ".tmp.npz")
            np.savez_compressed(tmp, **arrays)
            os.replace(tmp, os.path.join(self.out_dir, name))
            entry = {"file": name, "rows": len(rows), "response_tokens": int(sum(len(r) for _, r, *_ in rows))}
            if sp != "eval":
                every = self.holdout_every
                entry["split"] = "holdout" if every and index % every == every // 2 else "train"
            self.meta[key].append(entry)
            self._pending[sp] = []
            self.write_meta()

    def write_meta(self, **extra) -> None:
        self.meta.update(extra)
        _atomic_json(os.path.join(self.out_dir, META_FILE), self.meta)


def merge_datasets(out_dir: str, inputs: list[str]) -> dict:
    """One dataset from several v2 directories (hosts that distilled disjoint parts of a corpus,
    runs on other machines or days): every shard is copied under a new number with its split, and
    `source` indices are mapped onto the union of the inputs' sources. Rows keep their own
    directory's `items` numbering (meta["merged_from"] records which shard came from where), so a
    merged directory is for training, not for resuming a distillation. Returns the new meta."""
    if not inputs:
        raise ValueError("merge: give at least one dataset directory")
    if os.path.isfile(os.path.join(out_dir, META_FILE)):
        raise ValueError(f"merge: {out_dir} already holds a dataset; merge into a new directory")
    metas = [read_meta(d) for d in inputs]
    first = metas[0]
    for d, m in zip(inputs, metas):
        if m.get("format") != FORMAT:
            raise ValueError(f"merge: {d} holds a {m.get('format')} dataset; merge takes {FORMAT} directories")
        for key in ("vocab_size", "pad_id", "eos_token_ids", "token_dtype"):
            if m.get(key) != first.get(key):
                raise ValueError(f"merge: {d} has {key} {m.get(key)!r}, {inputs[0]} has {first.get(key)!r}")
    sources = list(dict.fromkeys(name for m in metas for name in m["sources"]))
    if len(sources) > 256:
        raise ValueError(f"merge: {len(sources)} distinct sources; a row's source is one byte (256 at most)")
    os.makedirs(out_dir, exist_ok=True)
    meta = {key: first[key] for key in ("format", "vocab_size", "pad_id", "eos_token_ids", "token_dtype")}
    meta.update(sources=sources, shards=[], eval_shards=[], merged_from=[])
    for d, m in zip(inputs, metas):
        remap = np.asarray([sources.index(name) for name in m["sources"]], np.uint8)
        record = {"dir": os.path.abspath(d), "files": {}, **{k: m[k] for k in ("corpus", "distill") if k in m}}
        for key, prefix in (("shards", "shard"), ("eval_shards", "eval")):
            for entry in m.get(key, []):
                name = f"{prefix}-{len(meta[key]):05d}.npz"
                tmp = os.path.join(out_dir, name + ".tmp.npz")
                if np.array_equal(remap, np.arange(len(remap))):  # same source numbering: the file as is
                    shutil.copyfile(os.path.join(d, entry["file"]), tmp)
                else:
                    rows = load_rows(d, entry["file"])
                    rows["source"] = remap[rows["source"]]
                    np.savez_compressed(tmp, **rows)
                os.replace(tmp, os.path.join(out_dir, name))
                meta[key].append({**entry, "file": name})
                record["files"][name] = entry["file"]
        meta["merged_from"].append(record)
    _atomic_json(os.path.join(out_dir, META_FILE), meta)  # last: a killed merge leaves no dataset
    return meta


def shard_files(meta: dict, split: str = "train") -> list[dict]:
    """Shards of a split: "train", "holdout", "eval" or "all" (train + holdout)."""
    if split == "eval":
        return list(meta.get("eval_shards", []))
    shards = meta["shards"]
    if split == "all":
        return list(shards)
    return [s for s in shards if s.get("split", "train") == split]


@dataclass(frozen=True)
class LoopCut:
    """Where a response has turned into a loop, and how much of the loop to keep.

    Position t of a response is *repeated* when the `ngram` tokens ending at t already occurred
    earlier in the response. A loop starts at the first position of a run of at least `run`
    repeated positions; the response is cut `keep` tokens after that start (a head still sees
    loops, which targets do produce, without hundreds of copies of one). run = 0 turns it off.
    Normal text repeats short phrases, not 32 positions in a row of 8-grams.
    """

    ngram: int = 8
    run: int = 32
    keep: int = 64

    def __post_init__(self):
        if self.run and (self.ngram < 2 or self.keep < 0):
            raise ValueError(f"LoopCut needs ngram >= 2 and keep >= 0, got ngram {self.ngram}, keep {self.keep}")

    def cut(self, response: np.ndarray) -> int:
        """How many tokens of `response` to keep (len(response) when it does not loop)."""
        n = len(response)
        if not self.run or n < self.ngram + self.run:
            return n
        grams = np.lib.stride_tricks.sliding_window_view(np.asarray(response, np.uint64), self.ngram)
        hashes = grams @ (np.uint64(1_000_003) ** np.arange(self.ngram, dtype=np.uint64))  # wraps mod 2^64
        _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
        repeated = first[inverse] < np.arange(len(hashes))  # gram ending at ngram-1+i seen before
        runs = np.convolve(repeated.astype(np.int32), np.ones(self.run, np.int32), mode="valid")
        full = np.flatnonzero(runs == self.run)
        if not len(full):
            return n
        start = int(full[0]) + self.ngram - 1  # the loop's first repeated token
        return min(n, start + self.keep)

    def cut_all(self, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """`cut` of every response tokens[starts[r]:ends[r]] of a shard at once ([n] int64, the same
        values unless two rows' 64-bit gram keys collide): one hash, sort and running count over the
        shard instead of a dozen numpy calls per row, which were most of the time a training run
        spent loading a 100k-row dataset."""
        starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
        n = ends - starts
        keep = n.copy()
        eligible = n >= self.ngram + self.run
        if not self.run or not eligible.any():
            return keep
        grams = np.lib.stride_tricks.sliding_window_view(np.asarray(tokens, np.uint64), self.ngram)
        hashes = grams @ (np.uint64(1_000_003) ** np.arange(self.ngram, dtype=np.uint64))  # as `cut`
        per_row = np.where(eligible, n - self.ngram + 1, 0)  # windows (grams) of each response
        row = np.repeat(np.arange(len(n)), per_row)
        local = np.arange(len(row)) - np.repeat(np.cumsum(per_row) - per_row, per_row)  # gram index in its row
        # one key per (row, gram): a gram is repeated when its key occurred earlier (rows are in order)
        key = hashes[np.repeat(starts, per_row) + local] ^ (row.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        repeated = first[inverse] < np.arange(len(key))
        count = np.concatenate([[0], np.cumsum(repeated)])
        i = np.arange(len(key))
        full_run = count[i + 1] - count[np.maximum(i + 1 - self.run, 0)] == self.run  # grams i-run+1..i repeated
        run_ends = np.flatnonzero((local >= self.run - 1) & full_run)
        if len(run_ends):
            rows, first = np.unique(row[run_ends], return_index=True)  # each looping row's first full run
            start = local[run_ends[first]] - self.run + 1 + self.ngram - 1
            keep[rows] = np.minimum(n[rows], start + self.keep)
        return keep


NO_LOOP_CUT = LoopCut(run=0)


def check_loop_cut(meta: dict, loop_cut: LoopCut) -> None:
    """A dataset whose distillation stopped rows inside loops (DistillConfig.stop_loops_after, with
    LoopCut's default ngram and run) holds at most that many loop tokens per row: training must cut
    loops by the same rule and keep no more of them, or it would learn that loops end early."""
    runs = [meta] + list(meta.get("merged_from", []))
    afters = {int(r.get("distill", {}).get("stop_loops_after", 0) or 0) for r in runs} - {0}
    if not afters:
        return
    after, default = min(afters), LoopCut()
    same_rule = loop_cut.run and (loop_cut.ngram, loop_cut.run) == (default.ngram, default.run)
    if not same_rule or loop_cut.keep > after:
        raise ValueError(f"the dataset's rows stop {after} tokens into a loop (distill stop_loops_after); the recipe's "
                         f"loop cut (ngram {loop_cut.ngram}, run {loop_cut.run}, keep {loop_cut.keep}) must use ngram "
                         f"{default.ngram}, run {default.run} and keep at most {after}")


def check_length_buckets(buckets, seq_len: int) -> None:
    """Batch lengths for length-bucketed loading must increase and end at the sequence length."""
    if buckets and (list(buckets) != sorted(set(buckets)) or buckets[-1] != seq_len):
        raise ValueError(f"length_buckets {tuple(buckets)} must increase and end at seq_len {seq_len}")


def plan_packing(lengths: np.ndarray, seq_len: int, window: int) -> list[np.ndarray]:
    """Documents packed into rows of `seq_len` tokens: each row lists the indices (into `lengths`,
    every length at most seq_len) of the documents it holds. First-fit decreasing within
    consecutive windows of `window` documents: a shuffled order stays shuffled beyond a window,
    and rows come out in window order."""
    lengths = np.asarray(lengths, np.int64)
    if len(lengths) and lengths.max() > seq_len:
        raise ValueError(f"a document of {int(lengths.max())} tokens does not fit a row of {seq_len}")
    rows: list[np.ndarray] = []
    for start in range(0, len(lengths), window):
        idx = np.arange(start, min(start + window, len(lengths)))
        room = np.zeros(len(idx), np.int64)  # free tokens of each row opened in this window
        members: list[list[int]] = []
        for d in idx[np.argsort(-lengths[idx], kind="stable")]:
            fits = room[: len(members)] >= lengths[d]
            r = int(np.argmax(fits)) if fits.any() else len(members)
            if r == len(members):
                members.append([])
                room[r] = seq_len
            room[r] -= lengths[d]
            members[r].append(int(d))
        rows += [np.asarray(m, np.int64) for m in members]
    return rows


@dataclass
class PackStats:
    rows: int = 0
    truncated: int = 0  # rows longer than seq_len (prompt + response cut at seq_len)
    no_response: int = 0  # rows whose prompt alone fills seq_len (nothing to learn from)
    dropped_tokens: int = 0
    loop_cut: int = 0  # rows whose response was cut where it started looping (LoopCut)
    loop_tokens: int = 0  # response tokens dropped by those cuts
    by_shard: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"rows": self.rows, "truncated": self.truncated, "no_response": self.no_response,
                "dropped_tokens": self.dropped_tokens, "loop_cut_rows": self.loop_cut,
                "loop_cut_tokens": self.loop_tokens}


_RESPONSE_KEEP: dict[tuple, np.ndarray] = {}


def response_keep(data_dir: str, name: str, rows: dict[str, np.ndarray], loop_cut: LoopCut) -> np.ndarray:
    """`loop_cut.cut_all` of the responses of shard `name` (its loaded `rows`), computed once per
    process for each (shard, rule): the training loader, the held-out loader and the data report
    read the same shards, and shard files are never rewritten."""
    key = (os.path.abspath(data_dir), name, loop_cut)
    if key not in _RESPONSE_KEEP:
        offs, plen = rows["offsets"], rows["prompt_lens"]
        _RESPONSE_KEEP[key] = loop_cut.cut_all(rows["tokens"], offs[:-1] + plen, offs[1:])
    return _RESPONSE_KEEP[key]


def pack_rows(rows: dict[str, np.ndarray], seq_len: int, pad_id: int, stats: PackStats | None = None,
              loop_cut: LoopCut = NO_LOOP_CUT, kept: np.ndarray | None = None):
    """(tokens [n, T] int32, loss_mask [n, T] bool, lengths [n] int32) of a v2 shard; each
    response first cut where it starts looping (`loop_cut`; `kept`: its cut lengths when already
    known, `response_keep`), then prompt + response cut at T."""
    n = len(rows["prompt_lens"])
    tokens = np.full((n, seq_len), pad_id, np.int32)
    mask = np.zeros((n, seq_len), bool)
    lengths = np.zeros((n,), np.int32)
    offs, plen = rows["offsets"], rows["prompt_lens"]
    if kept is None:
        kept = loop_cut.cut_all(rows["tokens"], offs[:-1] + plen, offs[1:])
    for r in range(n):
        seq = rows["tokens"][offs[r] : offs[r + 1]]
        p = int(plen[r])
        keep = int(kept[r])
        if keep < len(seq) - p:
            if stats is not None:
                stats.loop_cut += 1
                stats.loop_tokens += len(seq) - p - keep
            seq = seq[: p + keep]
        L = min(len(seq), seq_len)
        tokens[r, :L] = seq[:L]
        mask[r, min(int(plen[r]), L) : L] = True
        lengths[r] = L
        if stats is not None:
            stats.rows += 1
            if len(seq) > seq_len:
                stats.truncated += 1
                stats.dropped_tokens += len(seq) - seq_len
            if plen[r] >= seq_len:
                stats.no_response += 1
    return tokens, mask, lengths


def response_token_counts(data_dir: str, vocab_size: int, split: str = "train") -> np.ndarray:
    """How often each target token occurs in the responses of a split (picks the draft vocab)."""
    meta = read_meta(data_dir)
    counts = np.zeros((vocab_size,), np.int64)
    for s in shard_files(meta, split):
        rows = load_rows(data_dir, s["file"])
        offs, plen = rows["offsets"], rows["prompt_lens"]
        starts = offs[:-1] + plen
        keep = np.zeros(len(rows["tokens"]) + 1, np.int64)  # +1 at response start, -1 at row end
        np.add.at(keep, starts, 1)
        np.add.at(keep, offs[1:], -1)
        in_response = np.cumsum(keep[:-1]) > 0
        counts += np.bincount(rows["tokens"][in_response].astype(np.int64), minlength=vocab_size)[:vocab_size]
    return counts


def dataset_summary(data_dir: str) -> dict:
    """Rows and response tokens per split and per source."""
    meta = read_meta(data_dir)
    out: dict = {"splits": {}, "sources": {}}
    for split in ("train", "holdout", "eval"):
        files = shard_files(meta, split)
        out["splits"][split] = {"shards": len(files), "rows": sum(s["rows"] for s in files),
                                "response_tokens": sum(s["response_tokens"] for s in files)}
    for s in shard_files(meta, "all"):
        rows = load_rows(data_dir, s["file"])
        resp = np.diff(rows["offsets"]) - rows["prompt_lens"]
        for src, n_resp, temp, ended in zip(rows["source"], resp, rows["temperature"], rows["ended"]):
            name = meta["sources"][int(src)]
            row = out["sources"].setdefault(name, {"rows": 0, "response_tokens": 0, "sampled": 0, "ended": 0})
            row["rows"] += 1
            row["response_tokens"] += int(n_resp)
            row["sampled"] += int(temp > 0)
            row["ended"] += int(ended)
    return out


def length_stats(data_dir: str, seq_len: int, split: str = "train", loop_cut: LoopCut = NO_LOOP_CUT,
                 pack_window: int = 2048) -> dict:
    """What packing to `seq_len` does to a split: responses cut where they loop (and the tokens
    dropped), rows cut at seq_len (and tokens lost), rows with no response left, and the share of
    a batch that is padding, with one distilled row per training row ("padding_share") and with
    rows packed by `plan_packing` in windows of `pack_window` rows, in file order
    ("packed_padding_share"; the loader packs a shuffled order)."""
    meta = read_meta(data_dir)
    rows = cut = lost = empty = tokens = looped = loop_tokens = 0
    kept_lengths = []
    for s in shard_files(meta, split):
        z = load_rows(data_dir, s["file"])
        offs, plen = z["offsets"], z["prompt_lens"]
        lengths = np.diff(offs)
        if loop_cut.run:
            dropped = lengths - plen - response_keep(data_dir, s["file"], z, loop_cut)
            looped += int((dropped > 0).sum())
            loop_tokens += int(dropped.sum())
            lengths = lengths - dropped
        rows += len(lengths)
        cut += int((lengths > seq_len).sum())
        lost += int(np.maximum(lengths - seq_len, 0).sum())
        empty += int((plen >= seq_len).sum())
        tokens += int(np.minimum(lengths, seq_len).sum())
        kept_lengths.append(np.minimum(lengths, seq_len))
    packed_rows = len(plan_packing(np.concatenate(kept_lengths), seq_len, pack_window)) if kept_lengths else 0
    return {"rows": rows, "seq_len": seq_len, "loop_cut_rows": looped, "loop_cut_tokens": loop_tokens,
            "truncated_rows": cut, "truncated_tokens": lost, "rows_without_response": empty,
            "padding_share": round(1 - tokens / max(rows * seq_len, 1), 4),
            "packed_rows": packed_rows, "packed_padding_share": round(1 - tokens / max(packed_rows * seq_len, 1), 4)}
