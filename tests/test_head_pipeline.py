"""The head-training pipeline end to end on CPU with a tiny random target, as
scripts/gpu_pipeline.py runs it on a GPU host: corpus -> distillation on 8 devices -> EAGLE-3
training on the v2 shards -> LDLP, and the commands that script runs.

One module-scoped run; the tests check what each stage left behind."""

import json
import os

import jax
import numpy as np
import pytest
from pipeline_tiny import TARGET, CharChatTokenizer, tiny_sources

from jspec.checkpoint.eagle_format import EXTRAS_DIR, load_eagle_head, save_eagle_head
from jspec.generate import generate
from jspec.heads import eagle as H
from jspec.model import init_params
from jspec.speculative.policies.ldlp import load_ldlp
from jspec.train import corpus as C
from jspec.train import distill as D
from jspec.train import ldlp as TL
from jspec.train import shards as S
from jspec.train import step as ST
from jspec.train.config import RunConfig, TrainConfig
from jspec.train.testing import numpy_params
from jspec.train.trainer import train
from jspec.train.vocab import coverage_report

DC = D.DistillConfig(rows_per_device=2, refill_per_device=1, chunk_steps=4, max_new_tokens=10, max_prompt_tokens=64,
                     max_cont_prompt_tokens=64, self_prompts=8, self_prompt_max_new=8, rows_per_shard=8,
                     holdout_every=4, continuation_share=0.3, source_caps="chitchat=3")
TC = TrainConfig(kind="eagle3", ttt_steps=1, batch_size=8, seq_len=48, steps=6, lr=1e-2, warmup_ratio=0.2,
                 compute_dtype="float32", logits_chunk=8, length_buckets=(32, 48))
HCFG = H.default_head_config("eagle3", TARGET, draft_vocab_size=64)
ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    tok = CharChatTokenizer()
    sharegpt, chitchat, evals = tiny_sources()
    arrays = C.build_corpus(tok, TARGET, chat=True, sharegpt=sharegpt, chitchat=chitchat, extra=[], evals=evals,
                            progress=False)
    C.save_corpus(str(root / "corpus.npz"), arrays)
    corpus = C.load_corpus(str(root / "corpus.npz"))
    target = numpy_params(init_params, TARGET, seed=0, scale=0.3)
    data = str(root / "data")
    summary = D.distill(target, TARGET, tok, corpus, data, DC, chat=True, progress=False, log=lambda *_: None)
    run = root / "run" / "eagle3"
    # one device: the sharded train step is checked against one device in test_train.py
    res = train(HCFG, TC, target, data, str(run), run=RunConfig(ckpt_every=100, log_every=3, eval_every=3, eval_batches=1),
                mesh=ST.make_mesh(1, jax.devices()[:1]), head_params=numpy_params(H.init_head, HCFG, seed=1, scale=0.05),
                progress=False, lm_head_init="target", log_fn=lambda *_: None)
    save_eagle_head(str(run / "eagle"), HCFG, res.head_params, dtype="bfloat16")
    lc = TL.LDLPTrainConfig(k_max=2, seq_len=48, batch_rows=4, max_positions=400, eval_positions=100, hidden=16,
                            epochs=2, batch_size=64)
    ldlp_cfg = TL.train_ldlp_for_head(HCFG, res.head_params, target, data, str(run / "eagle" / EXTRAS_DIR), lc, pad_id=0,
                                      log=lambda *_: None)
    return dict(root=root, corpus=corpus, target=target, data=data, summary=summary, result=res, run=run,
                ldlp=ldlp_cfg, ldlp_config=lc)


def test_corpus_drops_eval_leaks_and_links_continuations(pipeline):
    corpus = pipeline["corpus"]
    stats = corpus.meta["stats"]
    assert stats["sharegpt_first"]["eval_normalized"] == 1  # "what is the capital of france"
    assert stats["sharegpt_first"]["kept"] == 24 and stats["sharegpt_cont"]["kept"] == 24
    conts = np.flatnonzero(corpus.parent >= 0)
    assert (corpus.parent[conts] < conts).all() and (corpus.parent[corpus.parent[conts]] == -1).all()
    assert [t for t, _ in corpus.eval_prompts()] == ["mt_bench", "humaneval", "chitchat"]


def test_distilled_rows_are_the_targets_answers(pipeline):
    data, target = pipeline["data"], pipeline["target"]
    meta = S.read_meta(data)
    assert {s["split"] for s in meta["shards"]} == {"train", "holdout"} and meta["eval_shards"]
    rows = [(S.row_tokens(r, i).tolist(), int(r["prompt_lens"][i]), float(r["temperature"][i]), int(r["items"][i]))
            for s in S.shard_files(meta, "all") for r in [S.load_rows(data, s["file"])] for i in range(len(r["items"]))]
    greedy = [(seq, p) for seq, p, t, _ in rows if t == 0][:6]
    ref = generate(target, TARGET, [seq[:p] for seq, p in greedy], max_new_tokens=DC.max_new_tokens)
    for b, (seq, p) in enumerate(greedy):
        assert ref.row(b) == seq[p:]
    assert any(t > 0 for _, _, t, _ in rows)  # a sampled share
    chitchat = C.SOURCES.index("chitchat")
    n_chitchat = sum(int((S.load_rows(data, s["file"])["source"] == chitchat).sum()) for s in S.shard_files(meta, "all"))
    assert n_chitchat == 3  # source_caps: 3 of the 7 chit-chat prompts
    for wave in pipeline["summary"]["waves"].values():  # where the wall time went, decode chunks apart
        assert min(wave["decode_s"], wave["refill_s"]) >= 0 and wave["decode_s"] + wave["refill_s"] <= wave["seconds"] + 0.1
    corpus = pipeline["corpus"]
    by_item = {item: seq for seq, _, _, item in rows}
    conts = [(seq, p, item) for seq, p, _, item in rows if item < len(corpus) and corpus.parent[item] >= 0]
    assert conts, "no continuation was answered"
    for seq, p, item in conts:  # parent's prompt + answer, then the turn suffix (its EOS not repeated)
        parent = by_item[int(corpus.parent[item])]
        assert seq[: len(parent)] == parent and seq[len(parent) : p] == corpus.ids(item)[1:]


def test_training_reads_v2_shards_with_target_lm_head(pipeline):
    res, run = pipeline["result"], pipeline["run"]
    assert res.finished and res.last_step == TC.steps
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert {"acc_0", "tokens_per_s_per_device", "elapsed_s"} <= set(rows[-1])
    held = [json.loads(line) for line in open(run / "holdout_metrics.jsonl")]
    assert [r["step"] for r in held] == [3, 6] and 0 <= held[-1]["acc_0"] <= 1
    hcfg, head = load_eagle_head(str(run / "eagle"), TARGET)
    assert hcfg.draft_vocab_size == 64
    cov = coverage_report(pipeline["data"], res.head_params["t2d"])
    assert set(cov) == {"mt_bench", "humaneval", "chitchat"} and 0 < cov["mt_bench"]["coverage"] <= 1


def test_ldlp_weights_saved_beside_the_head(pipeline):
    params, cfg = load_ldlp(str(pipeline["run"] / "eagle" / EXTRAS_DIR))
    assert cfg["d_model"] == TARGET.hidden_size and cfg["k_max"] == 2 and cfg["labels_from"] == "holdout"
    assert params["w_in"].shape == (2 * TARGET.hidden_size, 16)
    val = cfg["metrics"]["val"] or cfg["metrics"]["train"]
    assert val["positions"] > 0 and set(val["rounds"]) >= {"ldlp", "static_2"}


def test_ldlp_saved_before_its_evaluation_on_the_evaluation_answers(pipeline, tmp_path, monkeypatch):
    """A run killed (or out of time) while it labels the evaluation answers keeps its fitted predictor."""
    assert "eval_answers" in pipeline["ldlp"]["metrics"]  # the fixture's data has evaluation answers
    real_collect = TL.collect

    def collect(hcfg, head, target, data_dir, split, *args, **kw):
        if split == "eval":
            raise KeyboardInterrupt  # the kill
        return real_collect(hcfg, head, target, data_dir, split, *args, **kw)

    monkeypatch.setattr(TL, "collect", collect)
    with pytest.raises(KeyboardInterrupt):
        TL.train_ldlp_for_head(HCFG, pipeline["result"].head_params, pipeline["target"], pipeline["data"],
                               str(tmp_path / "ldlp"), pipeline["ldlp_config"], pad_id=0, log=lambda *_: None)
    params, cfg = load_ldlp(str(tmp_path / "ldlp"))
    assert params["w_in"].shape == (2 * TARGET.hidden_size, 16) and "eval_answers" not in cfg["metrics"]


def test_gpu_pipeline_runs_jspec_commands_on_paths(capsys):
    """scripts/gpu_pipeline.py (distill -> train -> LDLP -> bench on a host's GPUs) runs `jspec`
    commands that take paths: each one it would run parses with jspec's own parser, on the GPUs
    it names, and writes under the run directory."""
    import importlib.util
    import shlex

    from jspec.cli import build_parser

    spec = importlib.util.spec_from_file_location("gpu_pipeline", os.path.join(ROOT, "scripts", "gpu_pipeline.py"))
    gp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gp)
    assert gp.main(["pipeline", "--corpus", "c.npz", "--out", "/run", "--devices", "2", "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    steps = []
    for line in lines:
        env, *argv = shlex.split(line.partition(" > ")[0])
        args = build_parser().parse_args(argv[argv.index("jspec.cli") + 1 :])  # every flag exists
        steps.append((args.cmd, env.partition("=")[2]))
        out = getattr(args, "out", None) or getattr(args, "head", None)
        assert str(out).startswith("/run/"), line
    assert steps == [("distill", "0,1"), ("train-head", "0,1"), ("train-ldlp", "0"), ("bench", "0"), ("bench", "1"),
                     ("bench", "0")]
    with pytest.raises(SystemExit):
        gp.main(["distill", "--out", "/run", "--dry-run"])  # no corpus
    assert "needs --corpus" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["build-corpus", "distill", "merge-data", "train-ldlp", "train-head"])
def test_cli_has_the_pipeline_commands(command, capsys):
    from jspec.cli import main

    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0 and f"jspec {command}" in capsys.readouterr().out


def test_merge_data_joins_datasets_and_maps_sources(tmp_path, capsys):
    """Datasets distilled apart (other hosts, machines or days) train as one: every row, split and
    evaluation shard arrives, and each row's source keeps its name under the union of sources."""
    from jspec.cli import main

    def dataset(name, sources, n, first_item):
        w = S.RowWriter(str(tmp_path / name), vocab_size=TARGET.vocab_size, pad_id=0, eos_token_ids=(1,),
                        sources=sources, rows_per_shard=4, holdout_every=2)
        for i in range(n):
            w.add(np.asarray([2, 3]), np.asarray([5 + i, 1]), item=first_item + i, source=i % len(sources),
                  temperature=0.0, ended=True)
        w.add(np.asarray([2]), np.asarray([9, 1]), item=0, source=0, temperature=0.0, ended=True, split="eval")
        w.flush()
        return w.meta

    a, b = dataset("a", ["sharegpt", "chitchat"], 9, 0), dataset("b", ["self", "sharegpt"], 6, 100)
    assert main(["merge-data", "--out", str(tmp_path / "ab"), str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "15 rows" in capsys.readouterr().out
    meta = S.read_meta(str(tmp_path / "ab"))
    assert meta["sources"] == ["sharegpt", "chitchat", "self"]
    assert [s["split"] for s in meta["shards"]] == [s["split"] for s in a["shards"] + b["shards"]]
    assert len(meta["eval_shards"]) == 2

    def named_rows(d, m, split="all"):
        out = []
        for entry in S.shard_files(m, split):
            rows = S.load_rows(d, entry["file"])
            out += [(m["sources"][rows["source"][r]], S.row_tokens(rows, r).tolist()) for r in range(len(rows["items"]))]
        return out

    assert named_rows(str(tmp_path / "ab"), meta) == (named_rows(str(tmp_path / "a"), a) + named_rows(str(tmp_path / "b"), b))

    assert main(["merge-data", "--out", str(tmp_path / "ab"), str(tmp_path / "a")]) == 2  # not over a dataset
    other = S.RowWriter(str(tmp_path / "c"), vocab_size=TARGET.vocab_size + 1, pad_id=0, eos_token_ids=(1,), sources=["x"])
    other.add(np.asarray([2]), np.asarray([3, 1]), item=0, source=0, temperature=0.0, ended=True)
    other.flush()
    assert main(["merge-data", "--out", str(tmp_path / "ac"), str(tmp_path / "a"), str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "already holds a dataset" in err[0] and "vocab_size" in err[1]


def test_rows_stop_inside_loops_as_prefixes_of_the_whole_answers(pipeline):
    """DistillConfig.stop_loops_after: a row that loops is finished at the end of the chunk where
    the loop rule first cuts it, so its stored answer is the unstopped answer's prefix, at least
    `keep` tokens into the loop and at most one chunk more; rows that do not loop are untouched."""
    target, corpus = pipeline["target"], pipeline["corpus"]
    dc = D.DistillConfig(rows_per_device=2, refill_per_device=1, chunk_steps=4, max_new_tokens=40)
    mesh = D.data_mesh(jax.devices()[:2])
    engine = D.SlotEngine(jax.device_put(target), TARGET, mesh, dc, cache_len=D.cache_len_for(64, 40), max_new=40)
    jobs = [D.Job(i, corpus.ids(i), 0.0, 40) for i in range(12) if len(corpus.ids(i)) <= 64]
    rule = S.LoopCut(ngram=2, run=1, keep=2)  # any repeated bigram: a random tiny target rarely loops

    def answers(**kw):
        got = {}
        stats = engine.run(jobs, lambda job, resp: got.__setitem__(job.item, resp), stop_refill_at=float("inf"),
                           progress=False, **kw)
        return got, stats

    whole, _ = answers()
    stopped, stats = answers(stop_loops=rule)
    assert stats.loop_stopped > 0 and stats.rows == len(jobs)
    for item, resp in stopped.items():
        full = whole[item]
        assert resp == full[: len(resp)]
        if len(resp) < len(full):  # stopped: the rule cuts it, and it did not cut one chunk earlier
            assert rule.cut(np.asarray(resp)) < len(resp)
            assert rule.cut(np.asarray(resp[: len(resp) - dc.chunk_steps])) == len(resp) - dc.chunk_steps
    assert D.DistillConfig(stop_loops_after=64).loop_stop() == S.LoopCut(keep=64)
    assert D.DistillConfig().loop_stop() is None


def test_training_refuses_to_keep_more_loop_than_the_data_holds():
    meta = {"distill": {"stop_loops_after": 64}}
    S.check_loop_cut(meta, S.LoopCut(keep=64))
    S.check_loop_cut({"distill": {}}, S.LoopCut(run=0))  # whole rows: any cut
    for wrong in (S.LoopCut(keep=96), S.LoopCut(run=0), S.LoopCut(ngram=4)):
        with pytest.raises(ValueError, match="keep at most 64"):
            S.check_loop_cut(meta, wrong)
    merged = {"merged_from": [{"distill": {"stop_loops_after": 0}}, {"distill": {"stop_loops_after": 48}}]}
    with pytest.raises(ValueError, match="stop 48 tokens"):
        S.check_loop_cut(merged, S.LoopCut(keep=64))


def test_wave_zero_keeps_a_reserve_too_short_for_the_continuations():
    # a share of the time left goes to the continuations only where it can pay for their engine;
    # otherwise wave 0 refills until the deadline instead of leaving the reserve idle
    assert D.wave_zero_end(0.0, 1000.0, 0.2, True) == pytest.approx(800.0)
    assert D.wave_zero_end(0.0, 190.0, 0.2, True) == 190.0
    assert D.wave_zero_end(0.0, 1000.0, 0.2, False) == 1000.0
    assert D.wave_zero_end(0.0, float("inf"), 0.2, True) == float("inf")


def test_head_lineage_curve_adds_gpu_minutes_over_rounds(tmp_path):
    """scripts/plot_lineage.py on the Qwen head's committed lineage: one series per timed
    measurement, sequences and GPU-minutes growing round by round (starting again at a head
    trained from scratch), and a PNG written."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_lineage", os.path.join(ROOT, "scripts", "plot_lineage.py"))
    P = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(P)
    path = os.path.join(ROOT, "models", "qwen2.5-coder-1.5b-instruct", "head_lineage.json")
    with open(path) as fh:
        lineage = json.load(fh)
    curves = P.series(lineage["points"])
    chain = curves["h100: humaneval_chain_k6"]
    assert [p["version"] for p in lineage["points"]][:4] == ["v1", "v2", "v3", "v4"]
    assert len(chain) == sum("h100" in p for p in lineage["points"]) == 3
    assert all(a[0] < b[0] and a[1] < b[1] for a, b in zip(chain, chain[1:]))
    assert chain[0][1] == pytest.approx(13.0)
    # v4 is a new head trained from scratch: its GPU-minutes are its own, not v1-v3's added up
    (v4,) = curves["h200: humaneval_chain_k6"]
    assert v4[1] == pytest.approx(15.0) and v4[2] == pytest.approx(3.293)
    out = tmp_path / "curve.png"
    assert P.main([path, "--out", str(out)]) == 0 and out.stat().st_size > 10_000
    (tmp_path / "empty.json").write_text("{}")
    for bad in (str(tmp_path / "missing.json"), str(tmp_path / "empty.json")):
        with pytest.raises(SystemExit) as e:
            P.main([bad])
        assert e.value.code == 2
