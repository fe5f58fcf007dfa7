"""Packed training rows: several documents per row, no attention or label across a boundary.

A packed row's document must train exactly as it would alone in a row: the frozen target and the
head's TTT unroll attend within the document with positions from its start, and no loss counts a
label from the next document. Tiny models, float32, one compile per shape.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.heads import eagle as H
from jspec.model import init_params
from jspec.train import losses
from jspec.train.config import TrainConfig
from jspec.train.data import ShardedLoader, write_dataset
from jspec.train.shards import plan_packing
from jspec.train.testing import numpy_params, tiny_target_config

TARGET = tiny_target_config()
SEQ = 32
TC = TrainConfig(kind="eagle3", ttt_steps=3, batch_size=2, seq_len=SEQ, steps=1, compute_dtype="float32",
                 logits_chunk=8)
HCFG = H.default_head_config("eagle3", TARGET, draft_vocab_size=48)
HCFG1 = H.default_head_config("eagle1", TARGET)
TC1 = TrainConfig(kind="eagle1", ttt_steps=1, batch_size=2, seq_len=SEQ, steps=1, compute_dtype="float32",
                  logits_chunk=8)


def test_document_positions_and_mask():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1]], jnp.int32)
    np.testing.assert_array_equal(H.document_positions(seg), [[0, 1, 2, 0, 1, 0, 1], list(range(7))])
    mask = np.asarray(H.document_mask(seg))
    assert mask[0, 4].tolist() == [False, False, False, True, True, False, False]
    np.testing.assert_array_equal(mask[1], np.tril(np.ones((7, 7), bool)))


def test_plan_packing_places_every_document_once_within_the_row():
    lengths = np.random.default_rng(0).integers(1, 65, 500)
    rows = plan_packing(lengths, 64, window=100)
    assert sorted(np.concatenate(rows).tolist()) == list(range(500))
    assert max(lengths[r].sum() for r in rows) <= 64
    assert lengths.sum() / (64 * len(rows)) > 0.9  # first-fit decreasing fills the rows
    with pytest.raises(ValueError, match="does not fit a row of 64"):
        plan_packing(np.asarray([65]), 64, 10)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """60 rows of 3..6 prompt tokens and 2..20 response tokens, 4 shards."""
    rng = np.random.default_rng(1)
    rows = [(rng.integers(2, TARGET.vocab_size, rng.integers(3, 7)).tolist(),
             rng.integers(2, TARGET.vocab_size, rng.integers(2, 21)).tolist()) for _ in range(60)]
    d = str(tmp_path_factory.mktemp("packdata"))
    write_dataset(d, rows, seq_len=SEQ, pad_id=0, vocab_size=TARGET.vocab_size, rows_per_shard=16)
    return d


def test_packed_loader_is_deterministic_and_keeps_every_row_whole(data_dir):
    plain = ShardedLoader(data_dir, global_batch=4, seed=5)
    kw = dict(global_batch=4, seed=5, pack_documents=True, bucket_window=2)
    packed, again = ShardedLoader(data_dir, **kw), ShardedLoader(data_dir, **kw)
    n = packed.steps_in_epoch(0)
    assert n < plain.steps_in_epoch(0)
    docs, useful = [], 0
    for step in range(n):
        b = packed.batch(step)
        for k in b:
            np.testing.assert_array_equal(b[k], again.batch(step)[k])
        assert b["tokens"].shape == (4, SEQ) and b["segment_ids"].dtype == np.int32
        np.testing.assert_array_equal((b["segment_ids"] > 0).sum(1), b["lengths"])
        useful += int(b["lengths"].sum())
        for row, seg, mask in zip(b["tokens"], b["segment_ids"], b["loss_mask"]):
            for d in range(1, seg.max() + 1):
                docs.append((tuple(row[seg == d]), tuple(mask[seg == d])))
    whole = plain.batch(0)  # the same rows unpacked: prompt then response, padded
    rows = {}
    for s in range(plain.steps_in_epoch(0)):
        b = plain.batch(s)
        np.testing.assert_array_equal(b["segment_ids"], np.arange(SEQ)[None] < b["lengths"][:, None])
        for row, mask, n_tok in zip(b["tokens"], b["loss_mask"], b["lengths"]):
            rows[tuple(row[:n_tok])] = tuple(mask[:n_tok])
    assert whole["segment_ids"].max() == 1
    assert len(set(docs)) == len(docs) > 0.8 * len(rows)  # an epoch uses nearly every row once
    assert all(rows[t] == m for t, m in docs)  # each document whole, with its own loss mask
    plain_useful = sum(int(plain.batch(s)["lengths"].sum()) for s in range(n))
    assert useful > 1.5 * plain_useful  # more real tokens in the same number of steps
    two = [ShardedLoader(data_dir, process_index=h, process_count=2, **kw) for h in (0, 1)]
    assert two[0].steps_in_epoch(0) == two[1].steps_in_epoch(0) > 0
    with pytest.raises(ValueError, match="length_buckets must be"):
        ShardedLoader(data_dir, global_batch=4, pack_documents=True, length_buckets=(16, SEQ))
    with pytest.raises(ValueError, match="length_buckets must be"):
        TrainConfig(seq_len=SEQ, pack_documents=True, length_buckets=(16, SEQ))


def _models(hcfg=HCFG):
    target = numpy_params(init_params, TARGET, seed=0, scale=0.3)
    head = numpy_params(H.init_head, hcfg, seed=1, scale=0.05)
    return target, head


@functools.partial(jax.jit, static_argnums=(0, 1))
def _doc_loss_of(hcfg, tc, head, target, batch):
    """The TTT loss (and its gradient) over the loss_mask's positions, and the target's features."""
    out = losses.target_outputs(hcfg, tc, target, batch["tokens"], batch["segment_ids"])

    def loss_fn(params):
        return losses.ttt_loss(hcfg, tc, {**params, **fixed}, target, batch, out, jax.random.PRNGKey(0))

    trainable, fixed = H.split_trainable(head)
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
    return metrics, grads, out


def _doc_loss(head, target, batch):
    return _doc_loss_of(HCFG, TC, head, target, batch)


def _row(docs, width=SEQ):
    """One packed row of (prompt, response) documents: tokens, loss mask, segment ids."""
    tokens, mask, seg = np.zeros(width, np.int32), np.zeros(width, bool), np.zeros(width, np.int32)
    at = 0
    for d, (prompt, resp) in enumerate(docs, 1):
        n = len(prompt) + len(resp)
        tokens[at : at + n] = prompt + resp
        mask[at + len(prompt) : at + n] = True
        seg[at : at + n] = d
        at += n
    return tokens, mask, seg


def _batch(row, only):
    """A batch of one row whose loss counts only its document `only` (1-based)."""
    tokens, mask, seg = (x[None] for x in row)
    mask = mask & (seg == only)
    return {"tokens": jnp.asarray(tokens), "loss_mask": jnp.asarray(mask), "segment_ids": jnp.asarray(seg),
            "lengths": jnp.asarray((seg > 0).sum(1), jnp.int32)}


A = ([5, 6, 7], [20, 21, 22, 23, 24, 25, 26, 27])
A2 = ([9, 9, 9], [40, 41, 42, 43, 44, 45, 46, 47])  # document A with other tokens, same length
B = ([8, 3], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 60, 61])
C = ([11, 12, 13, 14], [50, 51, 52])


def test_no_token_attends_across_a_document_boundary():
    target, head = _models()
    m, g, out = _doc_loss(head, target, _batch(_row([A, B, C]), only=2))
    m2, g2, out2 = _doc_loss(head, target, _batch(_row([A2, B, C]), only=2))
    assert float(m["loss"]) > 0
    for k in m:  # B's losses and accuracies, bit for bit
        assert float(m[k]) == float(m2[k]), k
    for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(g2)):
        np.testing.assert_array_equal(x, y)
    b = slice(11, 11 + 14)  # B's positions in row 0
    np.testing.assert_array_equal(out.hidden[0, b], out2.hidden[0, b])
    for c, c2 in zip(out.captured, out2.captured):
        np.testing.assert_array_equal(c[0, b], c2[0, b])
    assert not np.array_equal(out.hidden[0, :11], out2.hidden[0, :11])  # A itself did change


@pytest.mark.parametrize("hcfg, tc", [(HCFG, TC), (HCFG1, TC1)], ids=["eagle3", "eagle1"])
def test_packed_row_trains_each_document_as_alone(hcfg, tc):
    target, head = _models(hcfg)
    for docs, k in (([A, B, C], 2), ([A, B, C], 1), ([C, B], 2), ([A, B, C], 3)):
        alone = _row([docs[k - 1]])
        m_packed, g_packed, _ = _doc_loss_of(hcfg, tc, head, target, _batch(_row(docs), only=k))
        m_alone, g_alone, _ = _doc_loss_of(hcfg, tc, head, target, _batch(alone, only=1))
        for key in m_packed:  # the same positions count, each reading the same features
            if key.startswith(("loss", "acc")):
                np.testing.assert_allclose(float(m_packed[key]), float(m_alone[key]), rtol=2e-5, err_msg=key)
        for x, y in zip(jax.tree.leaves(g_packed), jax.tree.leaves(g_alone)):
            np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-6)


def test_train_head_runs_data_parallel_on_every_device_and_reuses_compiled_programs(data_dir, tmp_path, monkeypatch,
                                                                                     capsys):
    """`jspec train-head` on the 8 fake devices: one data-parallel mesh over all of them, packed rows,
    and a second run (fresh in-memory caches) compiles nothing: every program comes from --compile-cache."""
    import argparse
    import json
    import os
    import sys
    import types

    from jax.experimental.compilation_cache import compilation_cache

    from jspec.train import cli

    presets = types.ModuleType("jspec.presets")
    presets.resolve_model = lambda name, **kw: (TARGET, numpy_params(init_params, TARGET, seed=0, scale=0.3), None)
    presets.list_presets = lambda: []
    monkeypatch.setitem(sys.modules, "jspec.presets", presets)
    recipe = {"head": {"kind": "eagle3", "draft_vocab_size": 48},
              "train": {"seq_len": SEQ, "batch_size": 8, "steps": 2, "ttt_steps": 2, "compute_dtype": "float32",
                        "logits_chunk": 8, "pack_documents": True},
              "run": {"log_every": 1, "ckpt_every": 100}}
    (tmp_path / "r.json").write_text(json.dumps(recipe))
    cache = tmp_path / "xla"

    def run(name):
        args = cli.add_train_args(argparse.ArgumentParser()).parse_args(
            ["--target", "tiny", "--recipe", str(tmp_path / "r.json"), "--data", data_dir, "--out", str(tmp_path / name),
             "--no-progress", "--compile-cache", str(cache)])
        return cli.train_from_args(args)

    events = []
    count = lambda name, **kw: events.append(name)  # noqa: E731
    saved = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")}
    jax.monitoring.register_event_listener(count)
    try:
        jax.clear_caches()  # programs earlier tests compiled in this process must compile here too
        first = run("a")
        programs = set(os.listdir(cache))
        first_events, events[:] = list(events), []
        jax.clear_caches()  # as a new process on the same host: nothing compiled in memory
        second = run("b")
        assert set(os.listdir(cache)) == programs
    finally:
        jax.monitoring.unregister_event_listener(count)
        for k, v in saved.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()
    hits, misses = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"
    assert first_events.count(misses) == len(programs) >= 2 and hits not in first_events
    assert events.count(hits) == len(programs) and misses not in events  # the second run compiled nothing
    assert first.last_step == second.last_step == 2
    assert first.losses == second.losses
    # the exported head attends as far back as it trained (rows of SEQ tokens), at least a drafted block
    from jspec.heads.eagle import MIN_ATTENTION_WINDOW
    exported = json.loads((tmp_path / "a" / "eagle" / "config.json").read_text())
    assert exported["jspec"]["attention_window"] == max(SEQ, MIN_ATTENTION_WINDOW)
    assert "training on 8 device(s): data 8 x fsdp 1, 1 rows" in capsys.readouterr().out
    with pytest.raises(ValueError, match="batch_size 12 does not split over 8 devices"):
        from jspec.train.trainer import train
        train(HCFG, TrainConfig(kind="eagle3", batch_size=12, seq_len=SEQ), None, data_dir, str(tmp_path / "c"))
