"""Draft-head training: data loader, loss decrease, exact resume, 8-device sharded step == 1 device.

Every training run here shares one TrainConfig per head kind and one mesh, so the jitted step
compiles once per (kind, mesh): the suite must stay fast on a 2-core CPU.
"""

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest

from jspec.errors import UsageError
from jspec.heads import eagle as H
from jspec.model import init_params
from jspec.train import step as S
from jspec.train.config import RunConfig, TrainConfig, load_recipe
from jspec.train.data import ShardedLoader, token_counts, write_dataset
from jspec.train.testing import numpy_params, tiny_target_config
from jspec.train.trainer import refit_steps, train

TARGET = tiny_target_config()
SEQ, BATCH, STEPS, KILL = 16, 8, 16, 10
TC3 = TrainConfig(kind="eagle3", ttt_steps=3, batch_size=BATCH, seq_len=SEQ, steps=STEPS, lr=1e-2,
                  warmup_steps=2, compute_dtype="float32", logits_chunk=8)
TC1 = TrainConfig(kind="eagle1", ttt_steps=1, batch_size=BATCH, seq_len=SEQ, steps=STEPS, lr=1e-2,
                  warmup_steps=2, compute_dtype="float32", logits_chunk=8, feature_noise_std=0.2)
RUN = RunConfig(ckpt_every=4, keep_checkpoints=2, log_every=4)
HCFG3 = H.default_head_config("eagle3", TARGET, draft_vocab_size=48)
HCFG1 = H.default_head_config("eagle1", TARGET)


def _mesh8():
    return S.make_mesh(2)  # data=4, fsdp=2 over the 8 fake CPU devices


def _mesh1():
    return S.make_mesh(1, jax.devices()[:1])


def _target():
    return numpy_params(init_params, TARGET, seed=0, scale=0.3)  # peaky target distributions


def _head(hcfg):
    return numpy_params(H.init_head, hcfg, seed=1, scale=0.05)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """40 rows of 4 prompt tokens + a patterned response (x <- 3x + c mod V), 5 shards."""
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(40):
        prompt = rng.integers(2, TARGET.vocab_size, 4).tolist()
        x, c, resp = int(rng.integers(2, 100)), int(rng.integers(1, 7)), []
        for _ in range(int(rng.integers(6, SEQ - 3))):
            x = (3 * x + c) % (TARGET.vocab_size - 2) + 2
            resp.append(x)
        rows.append((prompt, resp + [1]))
    d = str(tmp_path_factory.mktemp("data"))
    write_dataset(d, rows, seq_len=SEQ, pad_id=0, vocab_size=TARGET.vocab_size, rows_per_shard=8)
    return d


def test_loader_deterministic_and_split_over_hosts(data_dir):
    one = ShardedLoader(data_dir, global_batch=8, seed=3)
    again = ShardedLoader(data_dir, global_batch=8, seed=3)
    for step in (0, 4, 11):  # 5 steps per epoch: 11 is in the third epoch
        np.testing.assert_array_equal(one.batch(step)["tokens"], again.batch(step)["tokens"])
    epoch0 = np.concatenate([one.batch(s)["tokens"] for s in range(one.steps_in_epoch(0))])
    assert len({r.tobytes() for r in epoch0}) == 40  # an epoch visits every row once
    hosts = [ShardedLoader(data_dir, global_batch=8, seed=3, process_index=h, process_count=2) for h in (0, 1)]
    b = [h.batch(0) for h in hosts]
    assert b[0]["tokens"].shape == (4, SEQ)
    assert not {r.tobytes() for r in b[0]["tokens"]} & {r.tobytes() for r in b[1]["tokens"]}
    s = one.batch(0)
    assert s["loss_mask"].dtype == bool and s["lengths"].dtype == np.int32
    assert np.all(s["loss_mask"][:, :4] == 0) and np.all(s["loss_mask"].sum(1) == s["lengths"] - 4)
    everything = ShardedLoader(data_dir, global_batch=40).batch(0)  # one batch = the whole set
    assert token_counts(data_dir, TARGET.vocab_size).sum() == everything["loss_mask"].sum()


def test_length_buckets_pad_batches_to_their_longest_row(data_dir):
    plain = ShardedLoader(data_dir, global_batch=4, seed=3)
    kw = dict(global_batch=4, seed=3, length_buckets=(12, 14, SEQ), bucket_window=5)
    one, again = ShardedLoader(data_dir, **kw), ShardedLoader(data_dir, **kw)
    n = one.steps_in_epoch(0)
    assert n == plain.steps_in_epoch(0) == 10
    widths, rows = set(), set()
    for step in range(n):
        b = one.batch(step)
        np.testing.assert_array_equal(b["tokens"], again.batch(step)["tokens"])
        T = b["tokens"].shape[1]
        widths.add(T)
        assert T in kw["length_buckets"] and b["lengths"].max() <= T
        assert T == SEQ or b["lengths"].max() > {14: 12, 12: 0}[T]  # the smallest bucket that fits
        rows |= {tuple(r[:l]) for r, l in zip(b["tokens"], b["lengths"])}
    assert len(widths) > 1 and len(rows) == 40  # shorter batches exist; an epoch still sees every row
    with pytest.raises(ValueError, match="end at seq_len"):
        ShardedLoader(data_dir, global_batch=4, length_buckets=(8, 12))


@pytest.fixture(scope="module")
def straight_run(data_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("straight"))
    res = train(HCFG3, TC3, _target(), data_dir, out, run=RUN, mesh=_mesh8(), head_params=_head(HCFG3), progress=False)
    return out, res


def test_eagle3_loss_decreases_and_logs(straight_run):
    out, res = straight_run
    losses = [res.losses[s] for s in range(1, STEPS + 1)]
    assert np.mean(losses[-3:]) < 0.9 * np.mean(losses[:3]), losses
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [4, 8, 12, 16]
    assert {"loss", "loss_0", "acc_0", "acc_2", "grad_norm", "lr", "tokens_per_s"} <= set(rows[0])
    assert res.head_params["d2t"].shape == (48,) and res.last_step == STEPS


def test_eagle1_loss_decreases(data_dir, tmp_path):
    res = train(HCFG1, TC1, _target(), data_dir, str(tmp_path), run=RUN, mesh=_mesh1(),
                head_params=_head(HCFG1), progress=False)
    losses = [res.losses[s] for s in range(1, STEPS + 1)]
    assert np.mean(losses[-3:]) < 0.9 * np.mean(losses[:3]), losses


def test_kill_and_resume_reproduces_losses(straight_run, data_dir, tmp_path):
    _, full = straight_run
    out = str(tmp_path)
    first = train(HCFG3, TC3, _target(), data_dir, out, run=RUN, mesh=_mesh8(), head_params=_head(HCFG3),
                  stop_at=KILL, progress=False)  # "killed" after step 10; last checkpoint is step 8
    assert first.last_step == KILL
    resumed = train(HCFG3, TC3, _target(), data_dir, out, run=RUN, mesh=_mesh8(), head_params=_head(HCFG3),
                    resume=True, progress=False)
    assert min(resumed.losses) == 9 and resumed.last_step == STEPS
    for s in range(1, KILL + 1):
        assert first.losses[s] == pytest.approx(full.losses[s], abs=1e-6)
    for s in range(9, STEPS + 1):
        assert resumed.losses[s] == pytest.approx(full.losses[s], abs=1e-6), s
    for a, b in zip(jax.tree.leaves(resumed.head_params), jax.tree.leaves(full.head_params)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_sharded_step_matches_single_device(data_dir):
    target, head = _target(), _head(HCFG3)
    head = H.with_draft_vocab(HCFG3, head, token_counts(data_dir, TARGET.vocab_size))
    trainable, fixed = H.split_trainable(head)
    local = ShardedLoader(data_dir, BATCH, seed=0).batch(0)
    results = []
    for mesh in (_mesh1(), _mesh8()):
        state = S.place(mesh, S.init_state(TC3, trainable))
        batch = S.global_batch(mesh, local)
        fixed_on_mesh = S.place_replicated(mesh, fixed)  # as the trainer places them: one compile
        new, metrics = S.train_step(HCFG3, TC3, mesh, state, fixed_on_mesh, S.place(mesh, target), batch)
        if mesh.size == 8:
            wqkv = new["params"]["layer"]["wqkv"]
            assert wqkv.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
            assert batch["tokens"].sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"))
        results.append(jax.device_get((new["params"], metrics)))
    (p1, m1), (p8, m8) = results
    assert abs(float(m1["loss"]) - float(m8["loss"])) < 1e-5
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8)):
        np.testing.assert_allclose(a, b, atol=1e-5)


RECIPES = sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "training").glob("*.json"))


@pytest.mark.parametrize("name", RECIPES)
def test_recipes_parse(name):
    here = os.path.dirname(__file__)
    r = load_recipe(os.path.join(here, "..", "training", f"{name}.json"))
    assert r.train.kind == r.head.kind and r.train.steps > r.train.warmup_steps
    assert len(RECIPES) >= 7


class _CharTokenizer:
    """Stand-in tokenizer (no chat template): one id per character."""

    chat_template = None

    def __call__(self, text):
        return {"input_ids": [2 + ord(c) % (TARGET.vocab_size - 2) for c in text[:24]]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_cli_distills_dataset(tmp_path, monkeypatch):
    """`jspec train-head --distill-only` with a stand-in preset: prompts -> target answers -> shards."""
    import sys
    import types

    from jspec.train import cli
    from jspec.train.data import read_meta

    presets = types.ModuleType("jspec.presets")
    presets.resolve_model = lambda name: (TARGET, _target(), _CharTokenizer())
    presets.list_presets = lambda: []
    monkeypatch.setitem(sys.modules, "jspec.presets", presets)
    recipe = {"head": {"kind": "eagle3", "draft_vocab_size": 48},
              "data": {"num_prompts": 6, "self_prompts": 2, "max_new_tokens": 8, "gen_batch_size": 8, "rows_per_shard": 4},
              "train": {"seq_len": 48, "batch_size": 4, "steps": 2}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(recipe))
    out = tmp_path / "run"
    args = cli.add_train_args(__import__("argparse").ArgumentParser()).parse_args(
        ["--target", "tiny", "--recipe", str(path), "--out", str(out), "--distill-only", "--allow-cpu-distill", "--no-progress",
         "--compile-cache", "none"])  # the default cache would hold every later test's programs
    assert cli.run_train(args) is None
    meta = read_meta(str(out / "data"))
    assert meta["seq_len"] == 48 and sum(s["rows"] for s in meta["shards"]) == 8
    assert json.loads((out / "recipe.json").read_text())["train"]["seq_len"] == 48
    batch = ShardedLoader(str(out / "data"), 8).batch(0)
    assert batch["loss_mask"].any(axis=1).all()  # every row has a response to learn from


def test_loop_cut_keeps_normal_text_and_cuts_loops():
    from jspec.train.shards import LoopCut, PackStats, pack_rows

    rng = np.random.default_rng(0)
    text = rng.integers(0, 40000, 120)
    loop = np.tile(rng.integers(0, 40000, 9), 50)
    cut = LoopCut(ngram=8, run=32, keep=64)
    assert cut.cut(text) == 120  # no 8-gram repeats
    assert cut.cut(np.concatenate([text, text[:20], text[40:60]])) == 160  # short quotes stay
    n = cut.cut(np.concatenate([text, loop]))
    assert n == 120 + 9 + 7 + 64  # one cycle, then the first repeated 8-gram ends at +16; keep 64 more
    assert LoopCut(run=0).cut(np.concatenate([text, loop])) == 570
    seq = np.concatenate([[5, 6, 7], text, loop]).astype(np.uint16)
    rows = {"tokens": seq, "offsets": np.array([0, len(seq)]), "prompt_lens": np.array([3], np.int32)}
    stats = PackStats()
    tokens, mask, lengths = pack_rows(rows, 1024, 0, stats, loop_cut=cut)
    assert lengths[0] == 3 + n and mask[0].sum() == n and stats.loop_cut == 1 and stats.loop_tokens == 570 - n


def test_loop_cut_of_a_whole_shard_equals_the_cut_of_each_row():
    from jspec.train.shards import LoopCut

    rng = np.random.default_rng(1)
    seqs, prompts = [], []
    for _ in range(400):
        text = rng.integers(0, [5, 300, 40000][rng.integers(3)], rng.integers(0, 300))
        if rng.random() < 0.5 and len(text) > 10:  # a loop from a random point on
            text = np.concatenate([text[: rng.integers(len(text))], np.tile(rng.integers(0, 40000, rng.integers(1, 12)), 40)])
        prompts.append(int(rng.integers(0, 20)))
        seqs.append(np.concatenate([rng.integers(0, 40000, prompts[-1]), text]))
    offs = np.concatenate([[0], np.cumsum([len(x) for x in seqs])])
    tokens, starts = np.concatenate(seqs).astype(np.uint16), offs[:-1] + np.asarray(prompts)
    for cut in (LoopCut(), LoopCut(ngram=3, run=6, keep=0), LoopCut(run=0)):
        each = [cut.cut(tokens[a:b]) for a, b in zip(starts, offs[1:])]
        np.testing.assert_array_equal(cut.cut_all(tokens, starts, offs[1:]), each)
        assert cut.run == 0 or sum(np.asarray(each) < offs[1:] - starts) > 100


def test_warm_start_keeps_the_trained_head(straight_run, data_dir, tmp_path):
    """--init-head: training continues from a trained head, with its own draft vocabulary kept."""
    _, full = straight_run
    head = {k: np.asarray(v) for k, v in full.head_params.items() if k != "layer"} | {"layer": full.head_params["layer"]}
    ids = np.arange(TARGET.vocab_size - HCFG3.draft_vocab_size, TARGET.vocab_size)  # not the data's top ids
    head["d2t"], head["t2d"] = (np.asarray(x) for x in H.draft_vocab_maps(ids, TARGET.vocab_size))
    warm = train(HCFG3, TC3, _target(), data_dir, str(tmp_path), run=RUN, mesh=_mesh8(), head_params=head,
                 warm_start=True, lm_head_init="target", stop_at=2, progress=False)
    np.testing.assert_array_equal(np.asarray(warm.head_params["d2t"]), ids)
    np.testing.assert_allclose(np.asarray(warm.head_params["lm_head"]), np.asarray(head["lm_head"]), atol=0.05)


def test_init_head_must_exist_and_match_the_recipe(tmp_path):
    from jspec.checkpoint.eagle_format import save_eagle_head
    from jspec.train.cli import _warm_start

    with pytest.raises(UsageError, match="no exported head"):
        _warm_start(str(tmp_path), HCFG3, TARGET)
    save_eagle_head(str(tmp_path / "h"), HCFG3, _head(HCFG3) | dict(zip(("d2t", "t2d"), H.draft_vocab_maps(
        np.arange(HCFG3.draft_vocab_size), TARGET.vocab_size))), dtype="float32")
    hcfg, params = _warm_start(str(tmp_path / "h"), HCFG3, TARGET)
    assert hcfg.draft_vocab == HCFG3.draft_vocab and params["fc"].dtype == np.float32
    with pytest.raises(UsageError, match="differ from the recipe"):
        _warm_start(str(tmp_path / "h"), HCFG3.replace(draft_vocab_size=40), TARGET)


def test_export_dir_of_finished_and_stopped_runs(tmp_path):
    """A finished run exports to --export (default OUT/eagle); a stopped one only with
    --export-when-stopped, and then to OUT/eagle-step<N>, never to the finished head's place."""
    import argparse
    import types

    from jspec.train.cli import add_train_args, export_dir

    def args(*extra):
        return add_train_args(argparse.ArgumentParser()).parse_args(["--target", "t", "--recipe", "r", *extra])

    done = types.SimpleNamespace(finished=True, last_step=50)
    stopped = types.SimpleNamespace(finished=False, last_step=37)
    assert export_dir(args(), "run", done) == "run/eagle"
    assert export_dir(args("--export", "x"), "run", done) == "x"
    assert export_dir(args(), "run", stopped) is None
    assert export_dir(args("--export-when-stopped"), "run", stopped) == "run/eagle-step37"


def test_refit_shrinks_a_fitted_run_to_its_budget_and_never_grows_it():
    """The fit counts bare steps; evaluations and checkpoints cost more (a Gemma run fitted 863 steps
    at 0.271 s and stopped, unexported, at 808): the refit ends the run where the time runs out."""
    # 597 steps took 0.30 s each with the overheads; 70 s left: 70 / (0.30 * 1.04) = 224 more steps
    assert refit_steps(863, 600, 597, 597 * 0.30, 70.0) == 824
    assert refit_steps(863, 600, 597, 597 * 0.30, 1e6) == 863  # room to spare: the schedule stays
    assert refit_steps(863, 600, 597, 597 * 0.30, 0.0) == 600  # no room: end at the step just taken
    assert refit_steps(863, 600, 597, 597 * 0.30, -5.0) == 600


def test_a_fitted_run_whose_steps_slow_down_still_finishes_in_its_budget(data_dir, tmp_path, monkeypatch):
    """On a fake clock: the fit measures bare steps (about 0.01 s), then every fifth step costs 2 s
    more, as checkpoints and evaluations do. The run refits, finishes inside the budget (so it
    exports), and ends with its learning-rate schedule."""
    import dataclasses
    import time as time_module

    clock = {"t": 1000.0}

    def perf_counter():
        clock["t"] += 0.001
        return clock["t"]

    step_fn = S.train_step

    def slow_step(hcfg, tc, mesh, state, *rest):
        if int(state["step"]) >= 30 and int(state["step"]) % 5 == 0:
            clock["t"] += 2.0
        return step_fn(hcfg, tc, mesh, state, *rest)

    slow_step.lower = step_fn.lower
    monkeypatch.setattr(time_module, "perf_counter", perf_counter)
    monkeypatch.setattr(S, "train_step", slow_step)
    said = []
    res = train(HCFG3, dataclasses.replace(TC3, steps=100_000), _target(), data_dir, str(tmp_path), run=RUN,
                mesh=_mesh1(), head_params=_head(HCFG3), progress=False, deadline=perf_counter() + 50.0,
                fit_to_deadline=True, log_fn=said.append)
    assert any(line.startswith("fitted the run") for line in said), said
    assert any(line.startswith("refitted the run") for line in said), said
    assert res.finished and not res.stopped_by_budget and 30 < res.last_step < 100_000, (res.last_step, said)
    assert clock["t"] < 1000.0 + 50.0


def test_seq_len_override_cuts_the_recipes_length_buckets():
    """`train-head --seq-len N` on a recipe with length buckets keeps the buckets below N and ends
    them at N (a one-line fix a user would otherwise have to make in the recipe)."""
    import argparse

    from jspec.train.cli import _apply_overrides

    from jspec.train.config import recipe_from_dict

    recipe = recipe_from_dict({"train": {"seq_len": 640, "length_buckets": [256, 384, 512, 640]}})
    args = argparse.Namespace(steps=None, batch_size=None, seq_len=400, lr=None, seed=None, num_prompts=None, fsdp=None,
                              ckpt_every=None, log_every=None)
    train = _apply_overrides(recipe, args).train
    assert train.seq_len == 400 and train.length_buckets == (256, 384, 400)
    args.seq_len = None
    assert _apply_overrides(recipe, args).train.length_buckets == (256, 384, 512, 640)


def test_input_scale_rms_is_measured_trained_and_folded_on_export(data_dir, tmp_path):
    """head.input_scale "rms": fc_in_scale (powers of two, one per captured layer) is measured on
    the first rows, kept fixed by training, and folded into fc on export, exactly."""
    from jspec.checkpoint.eagle_format import load_eagle_head, save_eagle_head
    from jspec.model import forward, init_cache
    from jspec.train.trainer import capture_rms

    target = {k: (v * 64.0 if k == "embed" else v) for k, v in _target().items()}  # a huge residual stream
    res = train(HCFG3, TC3, target, data_dir, str(tmp_path / "run"), run=RUN, mesh=_mesh8(), head_params=_head(HCFG3),
                input_scale="rms", stop_at=2, progress=False)
    scale = np.asarray(res.head_params["fc_in_scale"])
    rows = ShardedLoader(data_dir, BATCH, TC3.seed, 0, 1, seq_len_override=SEQ).batch(0)
    want = H.capture_scales(capture_rms(HCFG3, target, rows))
    assert (want < 1 / 8).all() and np.array_equal(np.log2(want), np.round(np.log2(want)))
    np.testing.assert_array_equal(scale, np.repeat(want, TARGET.hidden_size))
    save_eagle_head(str(tmp_path / "eagle"), HCFG3, res.head_params, dtype="float32")
    _, loaded = load_eagle_head(str(tmp_path / "eagle"), TARGET)
    assert "fc_in_scale" not in loaded
    out = forward(target, TARGET, rows["tokens"][:2], init_cache(TARGET, 2, SEQ), capture=HCFG3.capture_layers)
    np.testing.assert_array_equal(np.asarray(H.fuse_captured(HCFG3, loaded, out.captured)),
                                  np.asarray(H.fuse_captured(HCFG3, res.head_params, out.captured)))


def test_target_lm_head_init_caps_the_logit_temperature():
    """lm_head_init "target": the target's rows and final norm, the norm scaled down only where a
    random unit-RMS head output would get logits sharper than TARGET_INIT_MAX_LOGIT_STD."""
    from jspec.train.vocab import TARGET_INIT_MAX_LOGIT_STD, init_lm_head_from_target, random_output_logit_std

    target, head = _target(), _head(HCFG3)
    gentle = init_lm_head_from_target(HCFG3, head, target)
    lm = np.asarray(gentle["lm_head"])
    np.testing.assert_array_equal(np.asarray(gentle["final_norm"]), np.asarray(target["final_norm"]))
    assert random_output_logit_std(np.asarray(gentle["final_norm"]), lm) < TARGET_INIT_MAX_LOGIT_STD
    sharp = init_lm_head_from_target(HCFG3, head, {**target, "final_norm": np.asarray(target["final_norm"]) * 1e3})
    sharp_std = random_output_logit_std(np.asarray(sharp["final_norm"]), lm)
    assert sharp_std == pytest.approx(TARGET_INIT_MAX_LOGIT_STD, rel=1e-4)
    np.testing.assert_array_equal(np.asarray(sharp["lm_head"]), lm)


def test_warm_start_with_input_scale_keeps_the_head_function(straight_run, data_dir, tmp_path):
    """--init-head of an exported head (scale folded into fc) under input_scale "rms": the scale is
    measured again and unfolded out of fc, so the head computes the same features it did."""
    from jspec.model import forward, init_cache

    _, full = straight_run
    head = jax.device_get(full.head_params)
    res = train(HCFG3, TC3, _target(), data_dir, str(tmp_path), run=RUN, mesh=_mesh1(), head_params=head,
                warm_start=True, input_scale="rms", stop_at=0, progress=False)
    assert "fc_in_scale" in res.head_params
    rows = ShardedLoader(data_dir, BATCH, TC3.seed, 0, 1, seq_len_override=SEQ).batch(0)
    out = forward(_target(), TARGET, rows["tokens"][:2], init_cache(TARGET, 2, SEQ), capture=HCFG3.capture_layers)
    np.testing.assert_allclose(np.asarray(H.fuse_captured(HCFG3, res.head_params, out.captured)),
                               np.asarray(H.fuse_captured(HCFG3, head, out.captured)), rtol=1e-6, atol=1e-6)


def test_train_head_rejects_a_named_dataset_that_is_not_there(tmp_path, monkeypatch):
    """A `--data` directory without a dataset (say the distillation failed) is a one-line error
    before the target loads, not a quiet distillation of the recipe's small prompt set."""
    import sys
    import types

    from jspec.errors import UsageError
    from jspec.train import cli

    presets = types.ModuleType("jspec.presets")

    def no_model(*a, **k):
        raise AssertionError("the target was loaded before --data was checked")

    presets.resolve_model, presets.list_presets = no_model, lambda: []
    monkeypatch.setitem(sys.modules, "jspec.presets", presets)
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"head": {"kind": "eagle3"}, "data": {"num_prompts": 6}, "train": {"seq_len": 48}}))
    args = cli.add_train_args(__import__("argparse").ArgumentParser()).parse_args(
        ["--target", "tiny", "--recipe", str(recipe), "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "run"), "--no-progress",
         "--compile-cache", "none"])
    with pytest.raises(UsageError, match="no dataset there"):
        cli.train_from_args(args)


def test_export_records_the_estimated_acceptance(tmp_path):
    """train-head's export carries an acceptance estimate from the last held-out evaluation, which
    `auto` plans with (factory.head_acceptance) until a timed run replaces it; no held-out file, no field."""
    from jspec.checkpoint.eagle_format import save_eagle_head
    from jspec.speculative.factory import head_acceptance, head_acceptance_by_temperature
    from jspec.train import cli

    params = _head(HCFG3) | dict(zip(("d2t", "t2d"), H.draft_vocab_maps(np.arange(HCFG3.draft_vocab_size),
                                                                         TARGET.vocab_size)))
    export = tmp_path / "eagle"
    save_eagle_head(str(export), HCFG3, params, dtype="float32",
                    acceptance=cli.estimated_acceptance(str(tmp_path / "missing.jsonl")))
    assert head_acceptance(export) is None
    holdout = tmp_path / "holdout_metrics.jsonl"
    holdout.write_text(json.dumps({"step": 200, "acc_0": 0.3}) + "\n"
                       + json.dumps({"step": 400, **{f"acc_{j}": 0.6 for j in range(7)}}) + "\n")
    save_eagle_head(str(export), HCFG3, params, dtype="float32", acceptance=cli.estimated_acceptance(str(holdout)))
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["jspec"]["kind"] == "eagle3" and "step 400" in cfg["jspec"]["acceptance"]["from"]
    assert head_acceptance(export) == 0.6 and head_acceptance_by_temperature(export) is None
    # a run that logged its held-out sampled acceptance records it for sampled plans, at its temperature
    holdout.write_text(json.dumps({"step": 600, **{f"acc_{j}": 0.6 for j in range(7)},
                                   **{f"accept_{j}": 0.4 for j in range(7)}}) + "\n")
    save_eagle_head(str(export), HCFG3, params, dtype="float32",
                    acceptance=cli.estimated_acceptance(str(holdout), temperature=0.7))
    assert head_acceptance(export) == 0.6 and head_acceptance_by_temperature(export) == ((0.7, 0.4),)


def test_training_steps_compile_with_cublas_products_on_gpus_only():
    assert S.training_compiler_options("gpu", env={}) == {"xla_gpu_enable_triton_gemm": False}
    assert S.training_compiler_options("gpu", env={"JSPEC_TRAIN_TRITON_GEMM": "1"}) is None
    assert S.training_compiler_options("cpu", env={}) is None and S.training_compiler_options("tpu", env={}) is None
    # XLA refuses a compile option it does not know, on every backend: a misspelt name would fail each GPU run
    square = jax.jit(lambda x: x @ x, compiler_options=S.GPU_TRAINING_COMPILER_OPTIONS)
    assert float(square(np.eye(2, dtype=np.float32)).sum()) == 2.0
    scaled = S.training_jit(lambda x, n: x * n, static_argnums=(1,))
    assert float(scaled(np.float32(2.0), 3)) == 6.0
    assert "mul" in scaled.lower(np.float32(2.0), 3).as_text()


def test_training_jit_compiles_with_the_gpu_options_static_and_donated_arguments(monkeypatch):
    monkeypatch.setattr(S, "training_compiler_options", lambda backend: dict(S.GPU_TRAINING_COMPILER_OPTIONS))
    step = S.training_jit(lambda n, state, x: (state + n * x, x.sum()), static_argnums=(0,), donate_argnums=(1,))
    state, total = step(2, jax.numpy.ones(3), jax.numpy.arange(3.0))
    np.testing.assert_allclose(np.asarray(state), [1.0, 3.0, 5.0])
    assert float(total) == 3.0
    step.lower(2, jax.numpy.ones(3), jax.numpy.arange(3.0)).compile()


def test_a_missing_or_broken_recipe_is_one_line(tmp_path):
    with pytest.raises(UsageError, match="no recipe at"):
        load_recipe(str(tmp_path / "none.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UsageError, match="is not JSON"):
        load_recipe(str(tmp_path / "bad.json"))


def test_eagle31_norms_train_export_and_must_match_a_warm_start(data_dir, tmp_path):
    """head.fc_norm / head.norm_output (EAGLE-3.1) as recipe switches: the head trains with its
    fc_norm weights learning, exports both flags and the weights, reloads computing the same
    features, and a warm start from a head without them is a one-line error."""
    from jspec.checkpoint.eagle_format import save_eagle_head
    from jspec.model import forward, init_cache
    from jspec.train.cli import _head_config, _warm_start
    from jspec.train.config import recipe_from_dict

    recipe = recipe_from_dict({"head": {"kind": "eagle3", "draft_vocab_size": 48, "fc_norm": True, "norm_output": True}})
    hcfg = _head_config(recipe, TARGET)
    assert hcfg.fc_norm and hcfg.norm_output
    with pytest.raises(ValueError, match="EAGLE-3.1"):
        recipe_from_dict({"head": {"kind": "eagle1", "fc_norm": True}})
    head = _head(hcfg)
    res = train(hcfg, TC3, _target(), data_dir, str(tmp_path / "run"), run=RUN, mesh=_mesh1(), head_params=head,
                stop_at=3, progress=False)
    assert np.all(np.isfinite([res.losses[s] for s in (1, 2, 3)]))
    assert not np.allclose(np.asarray(res.head_params["fc_norm"]), np.asarray(head["fc_norm"]))
    save_eagle_head(str(tmp_path / "eagle"), hcfg, res.head_params, dtype="float32")
    loaded_cfg, loaded = _warm_start(str(tmp_path / "eagle"), hcfg, TARGET)
    assert loaded_cfg.fc_norm and loaded_cfg.norm_output
    rows = ShardedLoader(data_dir, BATCH, TC3.seed, 0, 1, seq_len_override=SEQ).batch(0)
    out = forward(_target(), TARGET, rows["tokens"][:2], init_cache(TARGET, 2, SEQ), capture=hcfg.capture_layers)
    np.testing.assert_allclose(np.asarray(H.fuse_captured(loaded_cfg, loaded, out.captured)),
                               np.asarray(H.fuse_captured(hcfg, res.head_params, out.captured)), rtol=1e-6, atol=1e-6)
    with pytest.raises(UsageError, match="fc_norm, norm_output"):
        _warm_start(str(tmp_path / "eagle"), HCFG3, TARGET)
