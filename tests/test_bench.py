"""Bench harness: exact metric arithmetic on fake methods, JSON rows, BENCHMARKS.md and plots."""

import argparse
import json
import threading
import types

import numpy as np
import pytest

from jspec.bench import harness
from jspec.bench.cli import parse_timing_barrier
from jspec.bench.harness import RunContext, batches_of, benchmark_group
from jspec.bench.methods import JspecMethod, cut_at_eos, rows_from_generation
from jspec.bench.protocol import MethodSpec, RowResult, parse_method_spec, parse_method_specs
from jspec.bench.report import GENERATED_MARKER, ROW_FIELDS, group_tables, read_all_rows, write_benchmarks_md, write_rows
from jspec.errors import UsageError
from jspec.sampling import GREEDY, Sampling


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class FakeMethod:
    """Answers from a table: prompt (first token) -> (RowResult, seconds for a batch it starts)."""

    def __init__(self, clock, spec, table, *, batch=1, dtype="float32"):
        self.clock, self.table = clock, table
        self.name, self.method, self.drafter, self.policy, self.tree = spec.name, spec.method, spec.drafter, spec.policy, spec.tree
        self.batch, self.dtype = batch, dtype
        self.calls = []

    def prepare(self, example_prompts):
        return 1.5

    def run(self, prompts):
        self.calls.append([p[0] for p in prompts])
        self.clock.t += self.table[prompts[0][0]][1]  # the batch's wall time
        return [self.table[p[0]][0] for p in prompts]


PROMPTS = [[0, 7], [1, 7]]


def ar_table():
    return {0: (RowResult([5, 6, 7, 8], 4), 2.0), 1: (RowResult([9, 9], 2), 1.0)}


def spec_table():
    # prompt 0: same output as AR in 2 target calls; prompt 1 differs from AR, 1 call.
    return {
        0: (RowResult([5, 6, 7, 8], 2, drafted=4, accepted=2, draft_lengths=[2, 2], step_tokens=[2, 2]), 1.0),
        1: (RowResult([9, 1], 1, drafted=2, accepted=1, draft_lengths=[2], step_tokens=[2]), 0.5),
    }


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(harness, "_now", c)
    return c


def ctx():
    return RunContext(target="tiny", max_new_tokens=4, reproduce="python scripts/bench.py --model tiny",
                      card="cpu", jax_version="0.0.test", timestamp="2025-01-01T00:00:00+00:00")


def test_spec_bench_metrics_by_hand(clock):
    spec = parse_method_spec("spec:ngram:static")
    methods = [FakeMethod(clock, spec, spec_table()), FakeMethod(clock, MethodSpec("ar"), ar_table())]
    rows = {r["method"]: r for r in benchmark_group(ctx(), methods, PROMPTS, task="t")}
    ar, sp = rows["ar"], rows["spec"]
    assert ar["tokens_per_s"] == pytest.approx((4 / 2 + 2 / 1) / 2)  # mean over prompts
    assert ar["mean_accepted_tokens"] == 1.0 and ar["speedup_vs_ar"] == 1.0
    assert ar["greedy_identical_to_ar"] == 1.0 and ar["acceptance_rate"] is None
    assert sp["tokens_per_s"] == pytest.approx((4 / 1 + 2 / 0.5) / 2)
    assert sp["speedup_vs_ar"] == pytest.approx(2.0)
    assert sp["mean_accepted_tokens"] == pytest.approx(6 / 3)  # bonus tokens included
    assert sp["acceptance_rate"] == pytest.approx(3 / 6)
    assert sp["draft_tokens_per_round"] == pytest.approx(6 / 3)
    assert sp["greedy_identical_to_ar"] == 0.5
    assert sp["accepted_length_hist"] == {2: 3}
    assert sp["trace"] == {"draft_lengths": [2, 2], "step_tokens": [2, 2]}
    assert sp["compile_s"] == 1.5 and sp["n_prompts"] == 2 and sp["speedup_vs_hf"] is None


def test_batches_pad_the_last_group_and_drop_the_fillers(clock):
    assert batches_of([[1], [2], [3]], 2) == [([[1], [2]], 2), ([[3], [3]], 1)]
    prompts = [[0], [1], [2]]
    table = {0: (RowResult([1, 2, 3, 4], 4), 2.0), 1: (RowResult([1, 2], 2), 0.0), 2: (RowResult([1, 2, 3], 3), 1.0)}
    method = FakeMethod(clock, MethodSpec("ar"), table, batch=2)
    (row,) = benchmark_group(ctx(), [method], prompts, task="t")
    assert method.calls == [[0, 1], [2, 2]]
    assert row["tokens_per_s"] == pytest.approx(((4 + 2) / 2.0 + 3 / 1.0) / 2)  # per-batch, then mean
    assert row["n_prompts"] == 3 and row["mean_new_tokens"] == 3.0


def test_a_queue_method_serves_every_prompt_in_one_call(clock):
    prompts = [[0], [1], [2]]
    table = {0: (RowResult([1, 2, 3, 4], 4), 2.0), 1: (RowResult([1, 2], 2), 0.0), 2: (RowResult([1, 2, 3], 3), 1.0)}
    method = FakeMethod(clock, MethodSpec("ar"), table, batch=2)
    method.queue = True
    (row,) = benchmark_group(ctx(), [method], prompts, task="t")
    assert method.calls == [[0, 1, 2]]  # one call, two rows in flight inside it
    assert row["queue"] is True and row["batch"] == 2 and row["tokens_per_s"] == pytest.approx(9 / 2.0)
    # a queue row and a consecutive-batches row of the same method are two measurements in the tables
    (plain,) = benchmark_group(ctx(), [FakeMethod(clock, MethodSpec("ar"), table, batch=2)], prompts, task="t")
    lines = [ln for ln in group_tables([row, plain]).splitlines() if ln.startswith("| t |")]
    assert [ln.split(" | ")[2] for ln in lines] == ["2", "2 (queue)"]


def test_short_passes_repeat_and_each_batch_keeps_its_median_time(clock):
    class Noisy(FakeMethod):  # prompt 0's batch takes 2 s, then 9 s, then 2 s: the median is 2 s
        slow = iter([0.0, 7.0, 0.0])

        def run(self, prompts):
            if prompts[0][0] == 0:
                self.clock.t += next(self.slow)
            return super().run(prompts)

    method = Noisy(clock, MethodSpec("ar"), ar_table())
    (row,) = benchmark_group(ctx(), [method], PROMPTS, task="t", min_timed_s=14.0)
    assert method.calls == [[0], [1]] * 3  # 3 s, then 10 s more: 13 s < 14 s, so a third pass
    assert row["timed_passes"] == 3
    assert row["tokens_per_s"] == pytest.approx((4 / 2 + 2 / 1) / 2)
    one = FakeMethod(clock, MethodSpec("ar"), ar_table())
    (row,) = benchmark_group(ctx(), [one], PROMPTS, task="t")  # default: one pass
    assert one.calls == [[0], [1]] and row["timed_passes"] == 1


def test_methods_take_turns_pass_by_pass(clock):
    log = []

    class Logged(FakeMethod):
        def run(self, prompts):
            log.append(self.name)
            return super().run(prompts)

    ar = Logged(clock, MethodSpec("ar"), ar_table())
    spec = Logged(clock, parse_method_spec("spec:ngram:static"), spec_table())
    rows = benchmark_group(ctx(), [spec, ar], PROMPTS, task="t", min_timed_s=4.0)  # AR 3 s, spec 1.5 s a pass
    assert log == ["ar", "ar", "spec:ngram:static", "spec:ngram:static"] * 3  # until spec has 4.5 s
    assert [r["timed_passes"] for r in rows] == [3, 3]
    assert rows[1]["speedup_vs_ar"] == pytest.approx(2.0)


def test_timing_barrier_holds_the_timed_passes_until_every_process_compiled(clock, tmp_path):
    """Each group's timed passes start once `parties` processes have compiled that group; a
    missing process holds them only until the timeout; a bad --timing-barrier is a usage error."""
    log = []

    class Logged(FakeMethod):
        def prepare(self, example_prompts):
            log.append("compiled")
            return super().prepare(example_prompts)

        def run(self, prompts):
            log.append("timed")
            return super().run(prompts)

    barrier = harness.TimingBarrier(str(tmp_path / "b"), parties=2, timeout_s=30.0, poll_s=0.01)
    other = threading.Timer(0.3, lambda: (tmp_path / "b" / "000-other").touch())
    other.start()
    benchmark_group(ctx(), [Logged(clock, MethodSpec("ar"), ar_table())], PROMPTS, task="t", barrier=barrier)
    assert log[0] == "compiled" and set(log[1:]) == {"timed"} and barrier.group == 1
    alone = harness.TimingBarrier(str(tmp_path / "c"), parties=2, timeout_s=0.05, poll_s=0.01)
    assert alone.wait() is False  # nobody else came: time anyway
    assert parse_timing_barrier(None) is None and parse_timing_barrier(f"{tmp_path}:2").parties == 2
    for bad in ("2", f"{tmp_path}:0", f"{tmp_path}:x"):
        with pytest.raises(UsageError, match="DIR:N"):
            parse_timing_barrier(bad)


def test_group_must_share_batch_and_dtype(clock):
    a = FakeMethod(clock, MethodSpec("ar"), ar_table(), batch=1)
    b = FakeMethod(clock, MethodSpec("hf"), ar_table(), batch=2)
    with pytest.raises(ValueError, match="share batch"):
        benchmark_group(ctx(), [a, b], PROMPTS, task="t")


def test_method_spec_parsing():
    assert parse_method_spec("spec:eagle:svip:tree") == MethodSpec("spec", "eagle", "svip", True)
    assert parse_method_spec("hf_pld") == MethodSpec("hf", drafter="prompt_lookup")
    assert [s.name for s in parse_method_specs("ar,hf,hf_pld,spec:ngram:static")] == [
        "ar", "hf", "hf_pld", "spec:ngram:static"]
    for bad in ("spec:ngram", "beam", "spec:a:b:c"):
        with pytest.raises(ValueError):
            parse_method_spec(bad)


def test_method_specs_carry_arguments_and_are_all_checked_first():
    from jspec.bench.protocol import MethodSpecError
    from jspec.speculative.engines.tree import TreeConfig
    from jspec.speculative.verify.consultant import ConsultantRule

    spec = parse_method_spec("spec:early-exit:8:svip:k=7")
    assert (spec.drafter, spec.policy, spec.name) == ("early-exit:8", "svip", "spec:early-exit:8:svip:k=7")
    assert spec.generate_kwargs() == {"drafter": "early-exit:8", "k_max": 7, "policy": "svip"}
    tree = parse_method_spec("spec:eagle3:static:nodes=47:depth=8")
    assert tree.tree and tree.generate_kwargs()["tree"] == TreeConfig(top_k=10, depth=8, num_nodes=47)
    assert parse_method_spec("spec:eagle3:static:nodes=auto").generate_kwargs()["tree"] == "auto"
    kw = parse_method_spec("spec:eagle:adaedl:lambda_rule=B:lambda_init=0.3:verify=consultant:eps=3").generate_kwargs()
    assert (kw["policy"].lambda_rule, kw["policy"].lambda_init, kw["policy"].k_max) == ("B", 0.3, 8)
    assert kw["verify"] == ConsultantRule(eps=3.0)
    assert parse_method_spec("spec:model:static:k=3:verify=token").generate_kwargs()["verify"] == "token"
    assert "verify" not in parse_method_spec("spec:model:static:k=3").generate_kwargs()  # block verification
    # One bad entry fails the whole list before anything runs, naming the entry.
    for bad, message in [("spec:ngram:tapout", "draft distributions"), ("spec:ngram:static:tree", "EAGLE head"),
                         ("spec:eagle:svip:threshhold=1", "no field 'threshhold'"), ("spec:eagle:nosuch", "unknown policy"),
                         ("spec:ngram:static:k=0", "positive"), ("spec:eagle:static:eps=3", "verify=consultant"),
                         ("spec:eagle3:static:tree:verify=token", "verifies chains, not trees")]:
        with pytest.raises(MethodSpecError, match=message):
            parse_method_specs(f"ar,spec:ngram:static,{bad}")


def test_jspec_adapter_reads_generation_result():
    result = types.SimpleNamespace(
        tokens=np.array([[4, 5, 2, -1], [6, -1, -1, -1]], np.int32), lengths=np.array([3, 1]),
        target_calls=np.array([2, 1]), drafted=np.array([3, 0]), accepted=np.array([1, 0]), rounds=np.array([2, 1]),
        draft_lengths=np.array([[2, 1], [0, 0]]),
    )
    seen = {}

    def fake_generate(params, cfg, prompts, **kwargs):
        seen.update(kwargs, prompts=prompts)
        return result

    m = JspecMethod({}, None, parse_method_spec("spec:ngram:static"), dtype="float32", batch=2,
                    max_new_tokens=4, generate_kwargs={"k_max": 3}, generate_fn=fake_generate)
    rows = m.run([[1, 2], [3]])
    spec = seen.pop("speculative")  # the method's settings, grouped as generate() takes them
    assert seen == {"max_new_tokens": 4, "prompts": [[1, 2], [3]]}
    assert (spec.drafter, spec.policy, spec.k_max, spec.tree, spec.verify) == ("ngram", "static", 3, None, "lossless")
    assert rows[0] == RowResult([4, 5, 2], 2, 3, 1, draft_lengths=[2, 1], step_tokens=None)
    assert rows[1].new_tokens == [6] and rows[1].draft_lengths == [0]
    assert rows_from_generation(result)[1].target_calls == 1
    seen_prompts = []
    m.run = None  # prepare must not go through run
    m._generate_fn = lambda params, cfg, prompts, **kw: seen_prompts.append(prompts)
    m.prepare([[1] * 3, [1] * 5, [1] * 40, [1] * 9])  # buckets 32 and 64 -> one warm-up each
    assert [len(p[1]) for p in seen_prompts] == [5, 9]


def test_rows_name_the_rule_that_kept_the_drafts():
    """Sampled chains verify as blocks unless verify=token: rows say which rule ran, since rows
    from before block verification carry the same method names."""
    t1 = Sampling(temperature=1.0)

    def rule(method, sampling=GREEDY):
        return JspecMethod({}, None, parse_method_spec(method), dtype="float32", batch=1, max_new_tokens=4,
                           sampling=sampling).verify_rule

    assert rule("ar") is None and rule("spec:ngram:static") == "greedy"
    assert rule("spec:model:static:k=3", t1) == "block"
    assert rule("spec:model:static:k=3:verify=token", t1) == "token"
    assert rule("spec:eagle3:static:tree", t1) == "tree"
    assert rule("spec:eagle:static:verify=consultant", t1) == "consultant"


def test_cut_at_eos_keeps_the_eos():
    assert cut_at_eos([5, 3, 0, 0], [3]) == [5, 3]
    assert cut_at_eos([5, 6], [3]) == [5, 6]


def sample_rows(clock):
    specs = [MethodSpec("ar"), parse_method_spec("spec:ngram:static"), parse_method_spec("spec:ngram:heuristic")]
    tables = [ar_table(), spec_table(), spec_table()]
    return benchmark_group(ctx(), [FakeMethod(clock, s, t) for s, t in zip(specs, tables)], PROMPTS, task="mt_bench")


def test_rows_round_trip_with_every_field(clock, tmp_path):
    rows = sample_rows(clock)
    path = write_rows(tmp_path / "models" / "tiny" / "bench" / "run.json", rows)
    loaded = json.loads(path.read_text())
    assert len(loaded) == 3 and all(set(ROW_FIELDS) <= set(r) for r in loaded)
    assert read_all_rows(tmp_path / "models") == loaded
    with pytest.raises(ValueError, match="card"):
        write_rows(tmp_path / "x.json", [{"method": "ar"}])


def test_benchmarks_md_keeps_prose_and_regenerates_tables(clock, tmp_path):
    models = tmp_path / "models"
    write_rows(models / "tiny" / "bench" / "run.json", sample_rows(clock))
    md = tmp_path / "BENCHMARKS.md"
    write_benchmarks_md(models, md)  # absent: created with the default intro
    first = md.read_text()
    assert first.startswith("# Benchmarks") and GENERATED_MARKER in first
    md.write_text("# My notes\n\nhand-written\n" + GENERATED_MARKER + "\n\n| stale | table |\n")
    write_benchmarks_md(models, md)
    text = md.read_text()
    assert text.startswith("# My notes\n\nhand-written\n") and "stale" not in text
    assert "## tiny — cpu, JAX 0.0.test" in text
    assert "| mt_bench | `spec:ngram:static` | 1 | float32 | 2 | 4 | 4.0 | 2.00× | 2.00 | 0.50 | 2.00 | 0.50 |" in text
    assert "jspec bench --model tiny" in text  # rows written as `python scripts/bench.py` read in today's spelling


def test_plots_render(clock, tmp_path):
    from jspec.bench.plots import plot_all

    paths = plot_all(sample_rows(clock), tmp_path / "plots")
    names = sorted(p.name for p in paths)
    assert names == ["accepted_hist_mt_bench_b1_float32.png", "draft_traces_mt_bench_b1_float32.png",
                     "speedup_b1_float32.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


class CharTokenizer:
    """Byte-level stand-in for a base-model tokenizer (no chat template)."""

    chat_template = None
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1] + [2 + (b % 60) for b in text.encode()][:20]}


def test_prompts_past_the_context_are_refused_before_any_method_compiles(monkeypatch, capsys):
    import jax

    from jspec import cli as jspec_cli
    from jspec.bench import cli
    from jspec.config import ModelConfig
    from jspec.model import init_params

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=128, eos_token_ids=(3,))
    monkeypatch.setattr(cli, "resolve_model", lambda name: (cfg, init_params(cfg, jax.random.PRNGKey(0)), CharTokenizer()))
    monkeypatch.setattr(cli, "run_group", lambda *a, **k: pytest.fail("a method ran"))
    rc = jspec_cli.main(["bench", "--model", "tiny", "--tasks", "mt_bench", "--n-prompts", "2", "--max-new-tokens", "120",
                         "--methods", "ar"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "tokens + max_new_tokens 120 exceeds the model's context of 128 positions" in err, err


def test_cli_end_to_end_with_jspec_ar(tmp_path, monkeypatch, capsys):
    import jax

    from jspec.bench import cli
    from jspec.config import ModelConfig
    from jspec.model import init_params

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=128, eos_token_ids=(3,))
    params = init_params(cfg, jax.random.PRNGKey(0))
    monkeypatch.setattr(cli, "resolve_model", lambda name: (cfg, params, CharTokenizer()))
    common = ["--model", "tiny", "--tasks", "mt_bench", "--n-prompts", "3", "--max-new-tokens", "4", "--batch", "1,2",
              "--methods", "ar", "--models-dir", str(tmp_path / "models"), "--benchmarks-md", str(tmp_path / "B.md"),
              "--unroll", "2", "--no-plots"]
    # a user's run: rows, table and plots in a results folder of theirs (default ./jspec-results/<date-time>),
    # the table printed; nothing under models/ or in BENCHMARKS.md
    monkeypatch.chdir(tmp_path)
    rows = cli.run_bench(cli.add_bench_args(argparse.ArgumentParser()).parse_args(common))
    (results,) = (tmp_path / "jspec-results").iterdir()
    assert json.loads((results / "rows.json").read_text()) == rows
    assert "`ar` (unroll 2)" in (results / "table.md").read_text() and "`ar` (unroll 2)" in capsys.readouterr().out
    assert not (tmp_path / "models").exists() and not (tmp_path / "B.md").exists()
    assert [(r["batch"], r["n_prompts"], r["mean_accepted_tokens"]) for r in rows] == [(1, 3, 1.0), (2, 3, 1.0)]
    assert rows[0]["dtype"] == "float32" and rows[0]["card"] == "cpu" and rows[0]["tokens_per_s"] > 0
    assert rows[0]["reproduce"].startswith("jspec bench --model tiny ")
    # the project's rows: only with --commit-rows, which regenerates BENCHMARKS.md
    rows = cli.run_bench(cli.add_bench_args(argparse.ArgumentParser()).parse_args(common + ["--commit-rows", "b"]))
    assert all(r["unroll"] == 2 for r in rows) and "`ar` (unroll 2)" in (tmp_path / "B.md").read_text()
    assert json.loads((tmp_path / "models/tiny/bench/b.json").read_text()) == rows
    table = (tmp_path / "B.md").read_text()
    assert "jspec bench --model tiny" in table and "--batch 1,2" in table and "--unroll 2" in table
    assert "--commit-rows b" in table


def test_rows_name_the_drafters_weights(tmp_path, monkeypatch):
    import jax

    from jspec.bench import cli
    from jspec.checkpoint.eagle_format import save_eagle_head
    from jspec.config import ModelConfig
    from jspec.heads import eagle as H
    from jspec.model import init_params
    from jspec.speculative.policies.calibration import head_fingerprint

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                      num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=128, eos_token_ids=(3,))
    params = init_params(cfg, jax.random.PRNGKey(0))
    hcfg = H.default_head_config("eagle3", cfg)
    head = tmp_path / "head"
    save_eagle_head(str(head), hcfg, H.init_head(hcfg, jax.random.PRNGKey(1)))
    monkeypatch.setattr(cli, "resolve_model", lambda name: (cfg, params, CharTokenizer()))
    monkeypatch.chdir(tmp_path)
    args = ["--model", "tiny", "--tasks", "mt_bench", "--n-prompts", "2", "--max-new-tokens", "4", "--batch", "1",
            "--methods", f"ar,spec:ngram:static,spec:eagle3:{head}:static:k=2", "--no-plots", "--min-timed-s", "0"]
    rows = cli.run_bench(cli.add_bench_args(argparse.ArgumentParser()).parse_args(args))
    fingerprint = head_fingerprint(head)
    assert fingerprint and len(fingerprint) == 16
    assert [r["drafter_weights"] for r in rows] == [None, None, fingerprint]


def test_cli_queue_runs_ar_and_spec_with_rows_in_flight(tmp_path, monkeypatch):
    import jax

    from jspec.bench import cli
    from jspec.config import ModelConfig
    from jspec.model import init_params

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=128, eos_token_ids=(3,))
    params = init_params(cfg, jax.random.PRNGKey(0), scale=0.35)
    monkeypatch.setattr(cli, "resolve_model", lambda name: (cfg, params, CharTokenizer()))
    monkeypatch.chdir(tmp_path)
    args = ["--model", "tiny", "--tasks", "mt_bench", "--n-prompts", "5", "--max-new-tokens", "6", "--batch", "2",
            "--methods", "ar,spec:ngram:static", "--queue", "--no-plots", "--min-timed-s", "0"]
    rows = cli.run_bench(cli.add_bench_args(argparse.ArgumentParser()).parse_args(args))
    assert [(r["method"], r["queue"], r["batch"], r["n_prompts"]) for r in rows] == [("ar", True, 2, 5), ("spec", True, 2, 5)]
    assert rows[1]["greedy_identical_to_ar"] == 1.0 and "--queue" in rows[0]["reproduce"]
    with pytest.raises(UsageError, match="--refill 3: expected 1 to the smallest --batch"):
        cli.run_bench(cli.add_bench_args(argparse.ArgumentParser()).parse_args(args + ["--refill", "3"]))
    with pytest.raises(UsageError, match="--refill applies to --queue"):
        cli.run_bench(cli.add_bench_args(argparse.ArgumentParser()).parse_args(args[:-5] + ["ar", "--refill", "1"]))
    with pytest.raises(UsageError, match="--queue .* not hf"):
        cli.run_bench(cli.add_bench_args(argparse.ArgumentParser()).parse_args(args[:-5] + ["ar,hf", "--queue"]))


def test_hf_peer_batches_and_prompt_lookup_accounting(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from jspec.bench.methods import HFGenerateMethod, load_hf_model

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=3, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny")
    model = load_hf_model(str(tmp_path / "tiny"), dtype="float32")
    common = dict(eos_token_ids=[3], pad_token_id=0, dtype="float32", max_new_tokens=12)
    prompts = [[1, 5, 6, 7, 5, 6, 7, 5, 6], [1, 9, 10]]
    one = HFGenerateMethod(model, batch=1, **common)
    two = HFGenerateMethod(model, batch=2, **common)
    pld = HFGenerateMethod(model, batch=1, prompt_lookup_num_tokens=4, **common)
    singles = [one.run([p])[0] for p in prompts]
    assert [r.new_tokens for r in two.run(prompts)] == [r.new_tokens for r in singles]  # left padding is exact
    assert all(r.target_calls == len(r.new_tokens) and r.drafted == 0 for r in singles)
    for p, ref in zip(prompts, singles):
        (row,) = pld.run([p])
        assert row.new_tokens == ref.new_tokens  # greedy prompt lookup is lossless
        assert row.target_calls + row.accepted == len(row.new_tokens) and row.accepted <= row.drafted
    assert (pld.name, pld.method, pld.drafter) == ("hf_pld", "hf", "prompt_lookup")
    with pytest.raises(ValueError, match="batch 1"):
        HFGenerateMethod(model, batch=2, prompt_lookup_num_tokens=4, **common)


def test_bench_groups_plans_waves_with_one_barrier_each(tmp_path):
    """scripts/bench_groups.py: one process per GPU a wave, each wave's processes sharing a barrier
    sized to the wave; malformed groups are one-line errors."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_groups.py")
    spec = importlib.util.spec_from_file_location("bench_groups", path)
    bg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bg)
    groups = [bg.parse_group(f"g{i}=--model m --methods ar --batch 1") for i in range(3)]
    planned = bg.waves(groups, 2, tmp_path)
    assert [[(gpu, name) for gpu, name, _ in w] for w in planned] == [[(0, "g0"), (1, "g1")], [(0, "g2")]]
    first, last = planned[0][0][2], planned[1][0][2]
    assert first[first.index("--timing-barrier") + 1].endswith(":2") and last[last.index("--timing-barrier") + 1].endswith(":1")
    assert first[first.index("--out") + 1] == str(tmp_path / "g0")
    for bad in ("noname", "a b=--model m", "x=", "x=--model m --out elsewhere"):
        with pytest.raises(UsageError, match="--group"):
            bg.parse_group(bad)


def test_per_gpu_children_run_on_the_gpus_the_parent_was_given(monkeypatch):
    """measure_card_costs / bench_groups / gpu_pipeline start one process per GPU: under
    CUDA_VISIBLE_DEVICES=2,3 those are GPUs 2 and 3 (a cost table once ran on 0 and 1 beside
    another benchmark, and planned on its bad timings)."""
    from jspec.local_gpus import gpu_ids

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert gpu_ids(2) == ["2", "3"] and gpu_ids(1) == ["2"] and gpu_ids() == ["2", "3"]
    with pytest.raises(ValueError, match="4 GPU.s. asked for, but CUDA_VISIBLE_DEVICES=2,3 names 2"):
        gpu_ids(4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_ids(3) == ["0", "1", "2"]


def test_card_costs_time_the_shipped_heads_window():
    """The cost table's draft steps are timed with the shipped head's attention window, so their
    context slopes are those of the head that drafts."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "measure_card_costs.py")
    spec = importlib.util.spec_from_file_location("measure_card_costs", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    shipped = json.loads(mod.SHIPPED_HEAD.read_text())["jspec"]["attention_window"]
    assert mod.shipped_head_window() == shipped == 768


def test_card_costs_from_several_gpus_are_merged_as_they_come(tmp_path, monkeypatch):
    """measure_card_costs --gpus N merges each child's table into --out whenever the child saves one,
    so a run stopped by a time limit keeps every batch size measured so far, and stops its children."""
    import argparse
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "measure_card_costs.py")
    spec = importlib.util.spec_from_file_location("measure_card_costs", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    class Child:  # gpu 0 saves batch 1 and exits; gpu 1 saves batch 8 and is still running when the limit strikes
        def __init__(self, cmd, env):
            self.out = cmd[cmd.index("--out") + 1]
            self.batch = cmd[cmd.index("--batch") + 1]
            self.returncode = None
            json.dump({"verify_us": {self.batch: {"1": 1.0}}}, open(self.out, "w"))
            self.done = self.batch == "1"

        def poll(self):
            if self.done:
                self.returncode = 0
            return self.returncode

        def terminate(self):
            self.returncode = -15

    sleeps = []

    def limit(_):  # the first wait is where the time limit strikes
        sleeps.append(1)
        raise SystemExit(143)

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(mod.subprocess, "Popen", Child)
    monkeypatch.setattr(mod.time, "sleep", limit)
    monkeypatch.setattr(mod, "save_card_costs", lambda costs, p: json.dump(costs, open(p, "w")))
    out = tmp_path / "table.json"
    args = argparse.Namespace(gpus=2, batch=[1, 8], reps=1, draft_vocab=64, out=str(out), context=0)
    with pytest.raises(SystemExit):
        mod.spread(args)
    assert sleeps and json.loads(out.read_text())["verify_us"] == {"1": {"1": 1.0}, "8": {"1": 1.0}}
