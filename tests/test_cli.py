"""The command line as a new user meets it: bad arguments are one line `jspec: error: ...` with
exit code 2, caught before the model loads; the limits are named; the stats line reports
steady-state tok/s; `jspec bench` checks every method before running any."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jspec import cli
from jspec import model as M
from jspec.bench import cli as bench_cli
from jspec.config import ModelConfig
from jspec.speculative.drafters.base import DrafterError
from jspec.speculative.factory import find_ldlp_weights
from jspec.speculative.policies.ldlp import init_ldlp, save_ldlp

CFG = ModelConfig(
    arch="llama", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, eos_token_ids=(3,), max_position_embeddings=512,
)


class FakeTokenizer:
    chat_template = None

    def __call__(self, text):
        return {"input_ids": [4 + ord(c) % 40 for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


class ModelLoaded(Exception):
    """Raised by the stand-in loader: the arguments passed every check that runs before loading."""


@pytest.fixture
def no_model(monkeypatch):
    """The model's header (config) and tokenizer read as the CLI reads them before the weights;
    loading the weights raises ModelLoaded."""
    def refuse(*args, **kwargs):
        raise ModelLoaded

    monkeypatch.setattr(cli, "resolve_config", lambda *a, **k: CFG)
    monkeypatch.setattr(cli, "resolve_tokenizer", lambda *a, **k: FakeTokenizer())
    monkeypatch.setattr(cli, "resolve_model", refuse)
    monkeypatch.setattr(bench_cli, "resolve_model", refuse)
    monkeypatch.setattr(bench_cli, "resolve_config", lambda *a, **k: CFG)


@pytest.fixture
def tiny_model(monkeypatch):
    params = M.init_params(CFG, jax.random.PRNGKey(0), scale=0.35)
    monkeypatch.setattr(cli, "resolve_config", lambda *a, **k: CFG)
    monkeypatch.setattr(cli, "resolve_tokenizer", lambda *a, **k: FakeTokenizer())
    monkeypatch.setattr(cli, "resolve_model", lambda *a, **k: (CFG, params, None))


def run(capsys, *argv):
    rc = cli.main(list(argv))
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize("argv, message", [
    (["--policy", "nosuch"], "--policy applies only to speculative decoding: add --drafter"),
    (["--k-max", "4", "--verify", "consultant"], "--k-max, --verify apply only to speculative decoding"),
    (["--drafter", "ngram", "--policy", "nosuch"], "unknown policy 'nosuch'; valid names: static"),
    (["--drafter", "ngram", "--policy", "svip"], "reads draft distributions, which the 'ngram' drafter does not have"),
    (["--drafter", "nosuch"], "unknown drafter 'nosuch'"),
    (["--drafter", "early-exit:x"], "positive integer"),
    (["--drafter", "ngram", "--k-max", "0"], "--k-max must be >= 1"),
    (["--drafter", "ngram", "--consultant-eps", "3"], "--consultant-eps needs --verify consultant"),
    (["--drafter", "ngram", "--verify", "consultant", "--consultant-eps", "-1"], "eps must be > 0"),
    (["--drafter", "ngram", "--policy", "ldlp"], "policy ldlp predicts draft lengths for an EAGLE head"),
    (["--drafter", "ngram", "--ldlp-weights", "x"], "--ldlp-weights needs --policy ldlp"),
    (["--dtype", "foo"], "--dtype 'foo': choose from auto, float32, bfloat16, float16"),
    (["--drafter", "eagle3:{tmp}"], "is not an EAGLE head directory (no config.json or model.safetensors"),
    (["--drafter", "model:/nonexistent"], "/nonexistent is neither a draft-model checkpoint path nor a preset"),
    (["--drafter", "early-exit:99"], "exit layer 99 is outside the target's layers: use 1 to 1 (the target has 2)"),
    (["--drafter", "ngram", "--tree"], "trees need an EAGLE head drafter"),
    (["--drafter", "eagle3", "--tree", "--verify", "consultant"], "Consultant Decoding verifies chains, not trees"),
    (["--drafter", "eagle3", "--tree", "--verify", "token"], "--verify token verifies chains token by token"),
    (["--drafter", "eagle3", "--tree-nodes", "9"], "--tree-nodes needs --tree"),
    (["--drafter", "eagle3", "--tree", "--k-max", "4"], "--k-max sets a chain's draft length"),
    (["--drafter", "ngram", "--k-max", "100000"], "context of 512 positions"),
    (["--stop", ""], "--stop needs a non-empty string"),
    (["--prompt-file", "/nonexistent.txt"], "--prompt-file /nonexistent.txt: No such file or directory"),
    (["--mesh", "model=4"], "--mesh: model=4 must divide num_kv_heads=2, num_heads=4 and intermediate_size=64"),
    (["--drafter", "eagle3", "--tree", "--tree-nodes", "100000"], "--tree-nodes 100000: EAGLE-2's tree (top_k 10, "
                                                                  "depth 6) has at most 510 candidate nodes"),
    (["--chat"], "--chat: smollm2-135m-instruct has no chat template (a base model?): drop --chat"),
    (["--drafter", "eagle3+ngram"], "--drafter eagle3+ngram drafts trees (the head's tree plus an n-gram branch): add --tree"),
    (["--draft-vocab", "8"], "--draft-vocab applies only to speculative decoding"),
    (["--drafter", "ngram", "--draft-vocab", "8"], "a draft vocabulary is for draft models (--drafter model); 'ngram' is not one"),
    (["--drafter", "model", "--draft-vocab", "-3"], "draft_vocab must be an integer >= 1"),
    (["--drafter", "model", "--draft-vocab", "8", "--engine", "pearl"], "--engine pearl has its own schedule: drop --draft-vocab"),
])
def test_user_errors_are_one_line_before_the_model_loads(no_model, capsys, tmp_path, argv, message):
    rc, err = run(capsys, "generate", *[a.format(tmp=tmp_path) for a in argv], "hello")
    assert rc == 2
    assert err.startswith("jspec: error: ") and err.count("\n") == 1, err
    assert message in err, err


@pytest.fixture
def broken_drafters(tmp_path):
    """Drafters a user may point at that cannot serve CFG, under tmp_path: a truncated EAGLE head
    and tied draft model, a tied draft model made for another target, an HF model of another vocabulary."""
    from jspec.checkpoint.draft_format import save_draft_model
    from jspec.checkpoint.eagle_format import save_eagle_head
    from jspec.checkpoint.hf import hf_config_dict
    from jspec.heads import draft_model as DM
    from jspec.heads import eagle as H

    hcfg = H.default_head_config("eagle1", CFG)
    save_eagle_head(str(tmp_path / "truncated"), hcfg, H.init_head(hcfg, jax.random.PRNGKey(1)))
    params = M.init_params(CFG, jax.random.PRNGKey(0))
    dcfg, dparams = DM.init_from_target(params, CFG, (0,))
    save_draft_model(str(tmp_path / "truncated-draft"), dcfg, dparams, CFG, (0,), dtype="float32")
    for file in (tmp_path / "truncated" / "model.safetensors", tmp_path / "truncated-draft" / "model-00000.safetensors"):
        data = file.read_bytes()
        file.write_bytes(data[: 8 + int.from_bytes(data[:8], "little") + 16])  # the header, then 16 bytes of tensors
    other = CFG.replace(vocab_size=64)
    oparams = M.init_params(other, jax.random.PRNGKey(0))
    save_draft_model(str(tmp_path / "other-draft"), *DM.init_from_target(oparams, other, (0,)), other, (0,), dtype="float32")
    (tmp_path / "other-hf").mkdir()
    (tmp_path / "other-hf" / "config.json").write_text(json.dumps(hf_config_dict(CFG.replace(vocab_size=96))))


@pytest.mark.parametrize("drafter, message", [
    ("eagle3:{tmp}/truncated", "truncated/model.safetensors: tensor"),  # ... "past the end of the file ...; file truncated?"
    ("model:{tmp}/truncated-draft", "truncated-draft/model-00000.safetensors: tensor"),
    ("model:{tmp}/other-draft", "draft model was trained for another target (vocab_size 64 != 48"),
    ("model:{tmp}/other-hf", "the draft model's vocabulary (96 tokens) is not the target's (48 tokens)"),
])
def test_drafters_that_cannot_serve_the_target_are_one_line_before_the_weights_load(no_model, broken_drafters, capsys,
                                                                                    tmp_path, drafter, message):
    rc, err = run(capsys, "generate", "--drafter", drafter.format(tmp=tmp_path), "hello")
    assert rc == 2 and err.startswith("jspec: error: ") and err.count("\n") == 1, err
    assert message in err, err


def test_valid_arguments_reach_the_loader(no_model):
    with pytest.raises(ModelLoaded):
        cli.main(["generate", "--drafter", "ngram", "--policy", "heuristic", "--verify", "consultant",
                  "--consultant-eps", "2.5", "--consultant-smoothing", "0.2", "hello"])


def test_ldlp_weights_are_found_in_the_presets_head_jspec_folder(no_model, capsys, tmp_path, monkeypatch):
    models = tmp_path / "models"
    head = models / "tiny" / "heads" / "eagle3"
    head.mkdir(parents=True)
    (models / "tiny" / "preset.json").write_text(json.dumps(
        {"name": "tiny", "source": {"type": "path", "path": "x.gguf"}, "drafters": {"eagle3": "heads/eagle3"}}))
    monkeypatch.setenv("JSPEC_MODELS_DIR", str(models))
    rc, err = run(capsys, "generate", "--model", "tiny", "--drafter", "eagle3", "--policy", "ldlp", "hi")
    assert rc == 2 and "none ship with this head" in err and "jspec train-ldlp --head" in err
    save_ldlp(str(head), init_ldlp(CFG.hidden_size, jax.random.PRNGKey(0), hidden=8), {"d_model": CFG.hidden_size})
    with pytest.raises(DrafterError, match="none ship with this head"):  # in the head folder the engines read
        find_ldlp_weights("eagle3", "tiny")
    save_ldlp(str(head / "jspec"), init_ldlp(CFG.hidden_size, jax.random.PRNGKey(0), hidden=8), {"d_model": CFG.hidden_size})
    assert find_ldlp_weights("eagle3", "tiny") == head / "jspec"
    with pytest.raises(ModelLoaded):  # found: on to loading the model
        cli.main(["generate", "--model", "tiny", "--drafter", "eagle3", "--policy", "ldlp", "hi"])
    with pytest.raises(DrafterError, match="no LDLP predictor weights"):
        find_ldlp_weights("eagle3", "tiny", explicit=str(tmp_path))


def test_k_max_beyond_the_context_names_the_limit(tiny_model, capsys):
    rc, err = run(capsys, "generate", "--drafter", "ngram", "--k-max", "100000", "--max-new-tokens", "8", "hello")
    assert rc == 2 and err.splitlines()[-1].startswith("jspec: error: ")
    assert "context of 512 positions" in err and "k_max <= 498" in err  # 512 - 5 prompt - 8 new - 1


@pytest.mark.parametrize("extra", [[], ["--drafter", "ngram", "--policy", "heuristic"],
                                   ["--drafter", "ngram", "--no-stream", "--verify", "consultant"]])
def test_stats_report_steady_state_rate(tiny_model, capsys, extra):
    rc = cli.main(["generate", "--max-new-tokens", "6", *extra, "hello"])
    out = capsys.readouterr()
    assert rc == 0 and out.out.strip()
    assert "tok/s incl. compile" in out.err and "tok/s steady state" in out.err and "s compiling)" in out.err, out.err


def test_compile_clock_subtracts_compilation():
    clock = cli.CompileClock()
    with clock:
        jax.jit(lambda x: x * 3 + 1)(np.arange(7.0)).block_until_ready()
    assert 0 < clock.compile <= clock.wall
    assert "steady state" in clock.rates(10)


def test_bench_checks_every_method_before_loading(no_model, capsys):
    rc, err = run(capsys, "bench", "--model", "tiny", "--tasks", "", "--questions", "x.jsonl",
                  "--methods", "ar,spec:ngram:static,spec:ngram:tapout")
    assert rc == 2 and "spec:ngram:tapout" in err and "draft distributions" in err
    rc, err = run(capsys, "bench", "--model", "tiny", "--methods", "ar,spec:early-exit:8:svip:k=7:threshhold=1")
    assert rc == 2 and "no field 'threshhold'" in err


def test_bench_help_documents_the_method_grammar(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "spec:DRAFTER[:ARG]:POLICY[:OPTION]..." in out and "nodes=N|auto" in out and "k=N" in out


# ---- DiffuSpec: --drafter dlm[:PATH] -------------------------------------------------------------


@pytest.fixture
def tiny_dlm(tmp_path, monkeypatch):
    """A tiny DLM for CFG, shipped by a preset "tiny" (JSPEC_MODELS_DIR) at drafters/dlm."""
    from jspec.heads import dlm as D

    params = M.init_params(CFG, jax.random.PRNGKey(0), scale=0.35)
    dcfg = D.DLMConfig(target=CFG, num_layers=2, mask_token_id=5, block_size=8)
    directory = tmp_path / "models" / "tiny" / "drafters" / "dlm"
    directory.mkdir(parents=True)
    D.save_dlm(str(directory / "dlm.safetensors"), dcfg, D.init_dlm(dcfg, params), dtype=np.float32)
    (tmp_path / "models" / "tiny" / "preset.json").write_text(json.dumps(
        {"name": "tiny", "source": {"type": "path", "path": "x.gguf"}, "drafters": {"dlm": "drafters/dlm"}}))
    monkeypatch.setenv("JSPEC_MODELS_DIR", str(tmp_path / "models"))
    return directory


@pytest.mark.parametrize("spec", ["dlm", "dlm:{dir}", "dlm:{dir}/dlm.safetensors"])
def test_dlm_spec_accepted_before_loading(no_model, tiny_dlm, spec):
    with pytest.raises(ModelLoaded):
        cli.main(["generate", "--model", "tiny", "--drafter", spec.format(dir=tiny_dlm), "--policy", "adl", "hi"])


@pytest.mark.parametrize("argv, message", [
    (["--drafter", "dlm:/nonexistent"], "no DLM weights at /nonexistent"),
    (["--drafter", "dlm:{readme}"], "not a DLM written by scripts/train_dlm.py"),
    (["--model", "elsewhere.gguf", "--drafter", "dlm"], "no DLM given and none shipped for model 'elsewhere.gguf'"),
    (["--drafter", "dlm", "--k-max", "9"], "--k-max 9 is more than the DLM drafts in one forward (its block size, 8)"),
    (["--drafter", "dlm", "--policy", "svip"], "reads draft distributions, which the 'dlm' drafter does not have"),
])
def test_dlm_spec_errors_are_one_line(no_model, tiny_dlm, capsys, argv, message):
    argv = [a.format(readme=__file__) for a in argv]
    rc, err = run(capsys, "generate", "--model", "tiny", *argv, "hello")
    assert rc == 2 and err.startswith("jspec: error: ") and err.count("\n") == 1, err
    assert message in err, err


@pytest.mark.parametrize("argv, message", [
    (["--drafter", "eagle3"], "no eagle3 head given and none shipped for model 'tiny'"),
    (["--drafter", "eagle"], "no eagle head given and none shipped for model 'tiny'"),
    (["--drafter", "eagle3+ngram", "--tree"], "no eagle3 head given and none shipped for model 'tiny'"),
    (["--drafter", "model"], "no draft model given and none shipped for model 'tiny'"),
])
def test_a_drafter_the_model_does_not_ship_is_refused_before_loading(no_model, tiny_dlm, capsys, argv, message):
    """"tiny" ships a DLM only: a drafter named without PATH that it lacks is a one-line error
    before the weights load (no_model's loader would raise ModelLoaded), in generate and bench."""
    rc, err = run(capsys, "generate", "--model", "tiny", *argv, "hello")
    assert rc == 2 and err.startswith("jspec: error: ") and err.count("\n") == 1 and message in err, err
    drafter = argv[1]
    method = f"spec:{drafter}:static:tree" if "--tree" in argv else f"spec:{drafter}:static:k=3"
    rc, err = run(capsys, "bench", "--model", "tiny", "--methods", f"ar,{method}")
    assert rc == 2 and err.count("\n") == 1 and message in err, err


def test_a_draft_model_preset_not_installed_is_refused_before_loading(no_model, tmp_path, monkeypatch, capsys):
    """A draft model named as a preset (the one "tiny" ships, or model:NAME) whose pip parts are
    not installed is a one-line error naming what to install, before the target's weights load:
    only file sizes are read (the Qwen pair's bench took 23 s to say so)."""
    models = tmp_path / "models"
    for name, preset in (("tiny", {"name": "tiny", "source": {"type": "path", "path": "x.gguf"},
                                   "drafters": {"model": "tinydraft"}}),
                         ("tinydraft", {"name": "tinydraft", "source": {
                             "type": "pip_gguf_parts", "file": "tinydraft.gguf", "sha256": "0" * 64, "install": "make models-tiny",
                             "parts": [{"package": "jspec_absent_part1", "file": "data/part01.bin", "bytes": 10, "sha256": "0" * 64}]}})):
        (models / name).mkdir(parents=True)
        (models / name / "preset.json").write_text(json.dumps(preset))
    monkeypatch.setenv("JSPEC_MODELS_DIR", str(models))
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    for drafter in ("model", "model:tinydraft"):
        rc, err = run(capsys, "generate", "--model", "tiny", "--drafter", drafter, "hello")
        assert rc == 2 and err.count("\n") == 1 and f"drafter '{drafter}': tinydraft.gguf: not installed" in err, err
        assert "install with `make models-tiny`" in err
        rc, err = run(capsys, "bench", "--model", "tiny", "--methods", f"ar,spec:{drafter}:static:k=3")
        assert rc == 2 and err.count("\n") == 1 and "tinydraft.gguf: not installed" in err, err


def test_dlm_bench_methods_are_checked(no_model, tiny_dlm, capsys):
    from jspec.bench.protocol import parse_method_specs

    assert [s.name for s in parse_method_specs(f"spec:dlm:adl,spec:dlm:{tiny_dlm}:static:k=4")] == [
        "spec:dlm:adl", f"spec:dlm:{tiny_dlm}:static:k=4"]
    for methods, message in (("spec:dlm:adl:tree", "trees need an EAGLE head drafter"),
                             ("spec:dlm:svip", "draft distributions"),
                             ("spec:dlm:/nonexistent:adl", "no DLM weights at /nonexistent")):
        rc, err = run(capsys, "bench", "--model", "tiny", "--methods", f"ar,{methods}")
        assert rc == 2 and err.count("\n") == 1 and message in err, err


def test_dlm_generate_is_greedy_identical_to_ar(tiny_model, tiny_dlm, capsys):
    """--drafter dlm runs the shipped (here: the tiny preset's) DLM through the chain engine with
    ADL, streamed and batched; greedy output is the target's own."""
    cli.main(["generate", "--model", "tiny", "--max-new-tokens", "8", "--no-stream", "hello", "world!"])
    ar = capsys.readouterr()
    assert cli.main(["generate", "--model", "tiny", "--drafter", "dlm", "--policy", "adl", "--max-new-tokens", "8",
                     "--no-stream", "hello", "world!"]) == 0
    sp = capsys.readouterr()
    assert sp.out == ar.out and "drafter dlm policy adl" in sp.err, sp.err
    # one row in flight over the two prompts (continuous batching): the same text, in prompt order
    assert cli.main(["generate", "--model", "tiny", "--max-new-tokens", "8", "--batch-size", "1", "hello", "world!"]) == 0
    assert capsys.readouterr().out == ar.out
    rc, err = run(capsys, "generate", "--model", "tiny", "--batch-size", "0", "hi")
    assert rc == 2 and err.count("\n") == 1 and "--batch-size must be >= 1, got 0" in err, err


def test_generate_finishes_a_queue_in_a_tail(tiny_model, capsys):
    """--tail-rows: the queue's last rows finished in a smaller batch print the same text."""
    words = ["hello", "world!", "again", "and once more"]
    cli.main(["generate", "--model", "tiny", "--max-new-tokens", "8", "--no-stream", *words])
    ar = capsys.readouterr().out
    assert cli.main(["generate", "--model", "tiny", "--max-new-tokens", "8", "--batch-size", "3", "--tail-rows", "1",
                     *words]) == 0
    assert capsys.readouterr().out == ar
    for args, message in ((["--tail-rows", "1"], "--tail-rows applies to continuous batching: give --batch-size too"),
                          (["--batch-size", "2", "--tail-rows", "2"], "--tail-rows 2: 0 (never) up to fewer than --batch-size 2")):
        rc, err = run(capsys, "generate", "--model", "tiny", *args, "hi")
        assert rc == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.slow
def test_shipped_dlm_generate_matches_ar(monkeypatch, capsys):
    """`jspec generate --drafter dlm --policy adl` on the shipped preset (float32 on CPU): DiffuSpec
    greedy decoding is lossless, so the text is AR's. The model loads once for both runs."""
    from jspec.presets import resolve_model
    from jspec.speculative.factory import shipped_head_path

    preset = cli.DEFAULT_MODEL
    if shipped_head_path(preset, "dlm") is None:
        pytest.skip("no DLM shipped with the preset")
    loaded = resolve_model(preset)  # a preset that does not load is a failure, not a skip
    monkeypatch.setattr(cli, "resolve_model", lambda *a, **k: loaded)
    prompt = ["--chat", "--max-new-tokens", "8", "Give me three tips for better sleep."]
    assert cli.main(["generate", *prompt]) == 0
    ar = capsys.readouterr().out
    assert cli.main(["generate", "--drafter", "dlm", "--policy", "adl", *prompt]) == 0
    sp = capsys.readouterr()
    assert sp.out == ar and "drafter dlm policy adl" in sp.err, sp.err


# ---- checks before loading, bench arguments, convert, Orbax ------------------------------------------


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt 1 is empty"),
    ("x" * 600, "exceeds the model's context of 512 positions"),  # tokenized before the weights load
])
def test_prompts_are_checked_before_the_weights_load(no_model, capsys, prompt, message):
    rc, err = run(capsys, "generate", "hello", prompt)
    assert rc == 2 and err.startswith("jspec: error: ") and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "mtbench"], "--tasks: unknown task 'mtbench'; known tasks: mt_bench"),
    (["--n-prompts", "0"], "--n-prompts must be >= 1, got 0"),
    (["--batch", "0"], "--batch '0': expected a comma list of batch sizes >= 1"),
    (["--questions", "MISSING.jsonl"], "--questions MISSING.jsonl: no such file"),
    (["--dtype", "float16x"], "--dtype: unknown dtype 'float16x'"),
    (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 1, got -1"),
    (["--out", "x", "--commit-rows", "y"], "exclude each other"),
    (["--mesh", "model=4"], "--mesh: model=4 must divide num_kv_heads=2, num_heads=4 and intermediate_size=64"),
    (["--methods", "ar,spec:ngram:static:kk=1"], "valid options: k, verify, eps, smoothing, constants, vocab, nodes"),  # k once
])
def test_bench_argument_errors_are_one_line_before_loading(no_model, capsys, argv, message):
    rc, err = run(capsys, "bench", "--model", "tiny", *argv)
    assert rc == 2 and err.startswith("jspec: error: ") and err.count("\n") == 1 and message in err, err


def test_bench_help_documents_results_and_committed_rows(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "./jspec-results/" in out and "--commit-rows NAME" in out and "regenerate --benchmarks-md" in out
    assert "whose tables (below its marker line) are rebuilt" in out  # --benchmarks-md's own help


def test_convert_to_a_non_empty_directory_names_the_flag(capsys, tmp_path):
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "file").write_text("x")
    rc, err = run(capsys, "convert", "anything", str(tmp_path / "dst"))
    assert rc == 2 and err.count("\n") == 1 and "add --overwrite to replace it" in err and "overwrite=True" not in err


def test_truncated_orbax_checkpoint_is_one_line(tmp_path):
    """orbax's failed reads leave coroutines and tensorstore callbacks behind, which print dozens of
    traceback lines at exit unless restore_params collects them: the process prints one line."""
    import os
    import subprocess
    import sys

    from jspec.checkpoint.orbax_io import save_params

    save_params(tmp_path / "ck", M.init_params(CFG, jax.random.PRNGKey(0)), CFG)
    data = max((p for p in (tmp_path / "ck" / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[:1000])
    env = {**os.environ, "PYTHONPATH": str(Path(cli.__file__).parent.parent)}
    proc = subprocess.run([sys.executable, "-m", "jspec.cli", "info", "--model", str(tmp_path / "ck")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("jspec: error: ") and "truncated or corrupt?" in proc.stderr


def test_mesh_on_cpu_asks_xla_for_the_devices(tmp_path):
    """--mesh data=2 on a CPU host: the CLI sets --xla_force_host_platform_device_count before jax
    starts, so the mesh finds its devices (a fresh process: here jax already runs)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(Path(cli.__file__).parent.parent), JAX_PLATFORMS="cpu")
    code = "from jspec import cli; cli.ensure_cpu_devices('data=2,model=2'); import jax; print(jax.device_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.strip() == "4", out.stderr


# ---- new command-line features ---------------------------------------------------------------------


def test_version(capsys):
    import jspec

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"jspec {jspec.__version__}"


def test_prompts_from_a_file_or_stdin(tmp_path, monkeypatch):
    import io

    (tmp_path / "lines.txt").write_text("first prompt\n\nsecond prompt\n")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a\nmulti-line prompt"}) + "\n" + json.dumps("plain") + "\n")
    assert cli.prompts_from_file(str(tmp_path / "lines.txt")) == ["first prompt", "second prompt"]
    assert cli.prompts_from_file(str(tmp_path / "p.jsonl")) == ["a\nmulti-line prompt", "plain"]
    monkeypatch.setattr("sys.stdin", io.StringIO("x" * 300_000 + "\n"))  # beyond a command line's length
    assert cli.prompts_from_file("-") == ["x" * 300_000]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    with pytest.raises(cli.UsageError, match="bad.jsonl line 2: expected a JSON object with a \"prompt\" string"):
        cli.prompts_from_file(str(tmp_path / "bad.jsonl"))


def _rows(out: str) -> list[str]:
    """The generated texts of a several-prompt run (each headed by --- [i])."""
    return [part.strip() for part in out.split("--- [")[1:]]


def test_several_prompts_stream_in_turn_with_stop_strings(tiny_model, capsys, tmp_path):
    """Several prompts stream one after another with the batch's greedy text; a stop string ends a
    prompt's output right after it (lossless: a prefix of the text without it), streamed or
    batched, and the reason each prompt stopped is printed."""
    (tmp_path / "p.txt").write_text("hello\nworld!\n")
    assert cli.main(["generate", "--max-new-tokens", "6", "--no-stream", "--prompt-file", str(tmp_path / "p.txt")]) == 0
    batch = capsys.readouterr()
    texts = [t.partition("\n")[2] for t in _rows(batch.out)]
    assert len(texts) == 2 and all(texts) and batch.err.count("stopped: ") == 2
    assert cli.main(["generate", "--max-new-tokens", "6", "hello", "world!"]) == 0
    streamed = capsys.readouterr()
    assert [t.partition("\n")[2] for t in _rows(streamed.out)] == texts
    assert "stopped: --max-new-tokens 6 reached" in streamed.err or "stopped: EOS" in streamed.err
    stop = " ".join(texts[0].split()[:2])  # the first two tokens of prompt 0's text
    for mode in ([], ["--no-stream"]):
        assert cli.main(["generate", "--max-new-tokens", "6", *mode, "--stop", stop, "hello", "world!"]) == 0
        out = capsys.readouterr()
        cut = [t.partition("\n")[2] for t in _rows(out.out)]
        assert cut[0] == stop and f"stopped: stop string {stop!r}" in out.err, out
        assert texts[1].startswith(cut[1])


def test_stop_reason_names_eos_or_the_budget():
    cfg = CFG
    assert cli.stop_reason([5, 3], None, cfg, 8).startswith("EOS")
    assert cli.stop_reason([5, 6], None, cfg, 2) == "--max-new-tokens 2 reached"
    assert cli.stop_reason([5, 6], "x", cfg, 2) == "stop string 'x'"
    assert cli.cut_at_stop("ab. cd. ef", [" cd", "."]) == ("ab.", ".")


@pytest.mark.parametrize("script, argv, message", [
    ("acceptance_by_category.py", ["--model", "no-such-model", "--out", "{tmp}/a.json"], "neither an existing path nor a preset"),
    ("bench_dlm.py", ["--target", "no-such-model", "--dlm", "/nonexistent.safetensors", "--out", "{tmp}"], "no such file"),
])
def test_scripts_print_user_errors_as_one_line(script, argv, message, tmp_path):
    """The scripts end in the command line's handler: a bad argument is one line naming the script,
    exit code 2, no traceback."""
    root = os.path.join(os.path.dirname(__file__), "..")
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", script), *[a.format(tmp=tmp_path) for a in argv]],
                          capture_output=True, text=True, cwd=root, timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith(f"{script}: error: ") and message in last, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_report_user_errors_keeps_int_codes_and_maps_rows_to_zero(capsys):
    assert cli.report_user_errors(lambda: 3) == 3
    assert cli.report_user_errors(lambda: [{"row": 1}]) == 0 and cli.report_user_errors(lambda: None) == 0

    def bad():
        raise cli.UsageError("--thing must be >= 1,\n got 0")

    assert cli.report_user_errors(bad, "x.py") == 2
    assert capsys.readouterr().err == "x.py: error: --thing must be >= 1, got 0\n"


# ---- issue 57: what a new user hit -----------------------------------------------------------------


def _eagle_head(directory) -> Path:
    from jspec.checkpoint.eagle_format import save_eagle_head
    from jspec.heads import eagle as H

    hcfg = H.default_head_config("eagle1", CFG)
    save_eagle_head(str(directory), hcfg, H.init_head(hcfg, jax.random.PRNGKey(1)))
    return Path(directory)


def _target_json(tmp_path) -> Path:
    from jspec.checkpoint.hf import hf_config_dict

    path = tmp_path / "target.json"
    path.write_text(json.dumps(hf_config_dict(CFG)))
    return path


def test_export_head_errors_are_one_line_and_the_weights_readable(capsys, tmp_path):
    """export-head: a target that is not there is named as such (not "no head shipped"), a
    truncated head is one line naming its file, and the written weights are readable by others
    (0644 under umask 022, as config.json), not safetensors' private 0600."""
    head, target = _eagle_head(tmp_path / "head"), _target_json(tmp_path)
    rc, err = run(capsys, "export-head", "--for", "vllm", "--target", "/nonexistent", str(tmp_path / "a"))
    assert rc == 2 and err.count("\n") == 1 and "'/nonexistent' is neither an existing path nor a preset" in err, err
    assert cli.main(["export-head", "--for", "vllm", "--target", str(target), "--head", str(head), str(tmp_path / "b")]) == 0
    capsys.readouterr()
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "b").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] != 0o600, modes
    rc, err = run(capsys, "export-head", "--for", "vllm", "--target", str(target), "--head", str(head),
                  "--max-file-mb", "0.000001", str(tmp_path / "d"))
    assert rc == 2 and err.count("\n") == 1 and "over the per-file limit" in err and not (tmp_path / "d").exists(), err
    rc, err = run(capsys, "export-head", "--for", "vllm", "--target", str(target), "--head", str(head),
                  "--max-file-mb", "-1", str(tmp_path / "d"))
    assert rc == 2 and err.count("\n") == 1 and "--max-file-mb -1" in err, err
    weights = head / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: 8 + int.from_bytes(data[:8], "little") + 16])
    rc, err = run(capsys, "export-head", "--for", "vllm", "--target", str(target), "--head", str(head), str(tmp_path / "c"))
    assert rc == 2 and err.count("\n") == 1 and f"{weights}: tensor" in err and "file truncated?" in err, err


def test_an_hf_directory_without_a_tokenizer_is_named_as_such(capsys, tmp_path, monkeypatch):
    from jspec.checkpoint.hf import hf_config_dict

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config_dict(CFG)))
    monkeypatch.setattr(cli, "resolve_model", lambda *a, **k: pytest.fail("the weights loaded"))
    rc, err = run(capsys, "generate", "--model", str(tmp_path / "hf"), "hello")
    assert rc == 2 and err.count("\n") == 1 and "Orbax" not in err, err
    assert f"{tmp_path / 'hf'} has no tokenizer: {tmp_path / 'hf'} holds none of tokenizer.json" in err, err


@pytest.mark.parametrize("mode", [[], ["--no-stream"]])
def test_policy_auto_plans_in_generate(tiny_model, capsys, mode):
    """--policy auto prints its plan and runs it, streamed or batched (it planned nothing when the
    command line built the policy object: make_policy("auto") is not the name "auto")."""
    assert cli.main(["generate", "--drafter", "ngram", "--policy", "auto", "--max-new-tokens", "6", *mode, "hello"]) == 0
    err = capsys.readouterr().err
    assert "[jspec] auto plan (" in err and "expected" in err and "x plain decoding" in err, err


def test_auto_plans_on_every_api_path(monkeypatch):
    """generate() plans whatever form `auto` takes (the name, make_policy("auto"), a plan already
    made), and no other policy."""
    from jspec import generate as G
    from jspec.speculative.drafters.ngram import NgramDrafter
    from jspec.speculative.policies import is_auto, make_policy
    from jspec.speculative.policies.auto import REFERENCE_COSTS, plan_for

    planned = []

    def budget(plan, drafter, k_max, tree):
        planned.append(plan)
        return None, None, k_max, None  # plain decoding: the call stays cheap

    monkeypatch.setattr(G, "auto_budget", budget)
    params = M.init_params(CFG, jax.random.PRNGKey(0))
    made = plan_for(NgramDrafter(), REFERENCE_COSTS, batch=1, k_cap=4, tree=None)
    for policy in ("auto", make_policy("auto", k_max=4), made, "static", make_policy("heuristic", k_max=4)):
        assert is_auto(policy) == (policy in ("auto",) or policy is made or type(policy).__name__ == "AutoPolicy")
        G.generate(params, CFG, [[5, 6, 7]], max_new_tokens=2,
                   speculative=cli.SpeculativeConfig(drafter="ngram", policy=policy, k_max=4))
    assert len(planned) == 3 and planned[2] is made and all(isinstance(p, type(made)) for p in planned)


@pytest.mark.parametrize("kwargs, message", [
    (dict(drafter="foo"), "unknown drafter 'foo'"),
    (dict(drafter="ngram", policy="foo"), "policy='foo': choose a name (static, confidence"),
    (dict(drafter="ngram", policy=3), "policy=3: choose a name"),
    (dict(drafter="ngram", k_max=True), "k_max must be an integer >= 1, got True"),
    (dict(drafter="eagle3+ngram"), "drafter 'eagle3+ngram' drafts trees (the head's tree plus an n-gram branch): add "
                                   "tree=True or a TreeConfig"),
])
def test_speculative_config_rejects_what_cannot_run(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cli.SpeculativeConfig(**kwargs)


@pytest.mark.parametrize("prompts, message", [
    ("hello", "prompts must be a list of token-id lists, got a str: tokenize it (jspec.tokenizer.prompt_ids)"),
    ([5, 6, 7], "prompts must be a list of token-id lists, got a flat list of ids: pass [ids] for one prompt"),
    (["hello"], "prompt 0 is a str, not token ids: tokenize it (jspec.tokenizer.prompt_ids)"),
])
def test_generate_names_a_prompt_that_is_not_token_ids(prompts, message):
    from jspec.decode import PromptError

    with pytest.raises(PromptError, match=re.escape(message)):
        cli.generate({}, CFG, prompts, max_new_tokens=2)


def test_streamed_prompts_end_their_lines(tiny_model, capsys):
    assert cli.main(["generate", "--max-new-tokens", "4", "hello", "world!"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.splitlines()[0] == "--- [0]" and "--- [1]" in out.splitlines(), out


def test_accepted_tokens_never_exceed_the_tokens_emitted():
    """A round that accepts more drafts than the budget has room for counts only those emitted
    (the target drafting for itself: every draft is accepted)."""
    from jspec.speculative.drafters.model import ModelDrafter

    params = M.init_params(CFG, jax.random.PRNGKey(0), scale=0.35)
    spec = cli.SpeculativeConfig(drafter=ModelDrafter(CFG), drafter_params=params, k_max=8)
    for max_new in (3, 7):
        res = cli.generate(params, CFG, [[5, 6, 7], [8, 9]], max_new_tokens=max_new, speculative=spec)
        assert (res.drafted > 0).all() and (res.accepted <= res.lengths - 1).all(), (res.accepted, res.lengths)


def _calibrated_preset(tmp_path, monkeypatch, card: str) -> Path:
    """A preset "tiny" whose EAGLE head ships an svip fit for `card` only."""
    from jspec.speculative.policies.calibration import CALIBRATION_FORMAT, calibration_path

    models = tmp_path / "models"
    head = _eagle_head(models / "tiny" / "heads" / "eagle3")
    (models / "tiny" / "preset.json").write_text(json.dumps(
        {"name": "tiny", "source": {"type": "path", "path": "x.gguf"}, "drafters": {"eagle3": "heads/eagle3"}}))
    calibration_path(head).parent.mkdir(exist_ok=True)
    calibration_path(head).write_text(json.dumps({"format": CALIBRATION_FORMAT, "cards": {card: {
        "rounds": 40, "policies": {"svip": {"constants": {"threshold": 0.35}}}}}}))
    monkeypatch.setenv("JSPEC_MODELS_DIR", str(models))
    return head


def test_a_policy_says_which_cards_constants_it_runs(no_model, capsys, tmp_path, monkeypatch):
    """Another card's fit is not this card's: svip:calibrated is an error and svip runs the
    paper's constants, saying so; this card's fit is named with its rounds and file."""
    from jspec.cards import card_key
    from jspec.speculative.policies.calibration import calibration_path

    head = _calibrated_preset(tmp_path, monkeypatch, "NVIDIA_H200")
    rc, err = run(capsys, "generate", "--model", "tiny", "--drafter", "eagle3", "--policy", "svip:calibrated", "hi")
    assert rc == 2 and err.count("\n") == 1 and f"no svip fit for head {head} on {card_key()}" in err, err
    with pytest.raises(ModelLoaded):
        cli.main(["generate", "--model", "tiny", "--drafter", "eagle3", "--policy", "svip", "hi"])
    assert f"policy svip: the paper's constants (no `jspec calibrate` fit for this head on {card_key()})" in \
        capsys.readouterr().err
    _calibrated_preset(tmp_path, monkeypatch, card_key())
    with pytest.raises(ModelLoaded):
        cli.main(["generate", "--model", "tiny", "--drafter", "eagle3", "--policy", "svip:calibrated", "hi"])
    assert f"policy svip:calibrated: calibrated on {card_key()} from 40 recorded rounds ({calibration_path(head)})" in \
        capsys.readouterr().err


def _train_args(tmp_path, *extra) -> list[str]:
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"head": {"kind": "eagle3", "draft_vocab_size": 32},
                                  "train": {"seq_len": 16, "batch_size": 64, "steps": 2}}))
    return ["train-head", "--target", "tiny", "--recipe", str(recipe), "--compile-cache", "none", "--no-progress", *extra]


def test_train_head_asks_before_distilling_on_a_cpu(capsys, tmp_path, monkeypatch):
    """train-head is meant for GPUs: on a CPU it distils nothing unless asked, and its run directory
    is --out or the user cache, never ./runs."""
    from jspec.train import cli as train_cli

    monkeypatch.chdir(tmp_path)
    rc, err = run(capsys, *_train_args(tmp_path))
    assert rc == 2 and err.count("\n") == 1, err
    assert "train-head is meant for GPUs, and this host has none" in err and "--allow-cpu-distill" in err, err
    assert not (tmp_path / "runs").exists()
    args = train_cli.add_train_args(__import__("argparse").ArgumentParser()).parse_args(_train_args(tmp_path)[1:])
    assert Path(train_cli.run_dir(args)) == Path(os.environ["JSPEC_CACHE"]) / "runs" / "r-tiny"


def test_train_head_with_too_few_rows_for_a_batch_is_one_line(capsys, tmp_path, monkeypatch):
    from jspec.train.data import write_dataset

    write_dataset(str(tmp_path / "data"), [([2, 3, 4], [5, 6, 1])] * 6, seq_len=16, pad_id=0, vocab_size=48, rows_per_shard=8)
    monkeypatch.setattr("jspec.presets.resolve_model", lambda *a, **k: pytest.fail("the weights loaded"))
    rc, err = run(capsys, *_train_args(tmp_path, "--data", str(tmp_path / "data")))
    assert rc == 2 and err.count("\n") == 1, err
    assert "too few rows for a local batch of 64: lower --batch-size (the recipe's 64) or distil more rows" in err, err


def test_an_instruct_preset_wraps_prompts_in_its_chat_template_by_default(monkeypatch):
    """`jspec generate "..."` on an instruct preset (preset.json "chat": true) uses its chat template
    without --chat; --no-chat sends the text as it is; a checkpoint path takes the text as it is."""
    parse = lambda *argv: cli.build_parser().parse_args(["generate", *argv])  # noqa: E731
    assert parse("hi").chat is None and parse("--chat", "hi").chat is True and parse("--no-chat", "hi").chat is False
    assert cli.preset_chat("smollm2-135m-instruct") and not cli.preset_chat("/some/checkpoint")
    base = [p for p in cli.list_presets() if not cli.load_preset(p).chat]
    assert all(not cli.preset_chat(p) for p in base)
    seen = []
    monkeypatch.setattr(cli, "prompt_ids", lambda tok, text, chat: seen.append(chat) or [5, 6, 7])
    monkeypatch.setattr(cli, "has_chat_template", lambda tok: True)
    monkeypatch.setattr(cli, "resolve_tokenizer", lambda model: object())
    monkeypatch.setattr(cli, "pack_prompts", lambda *x, **k: (_ for _ in ()).throw(RuntimeError("built")))
    for argv, chat in ((["hi"], True), (["--no-chat", "hi"], False), (["--chat", "hi"], True)):
        with pytest.raises(RuntimeError, match="built"):  # stops once the prompts are built, before any weights
            cli.load_checked(parse(*argv))
        assert seen.pop() is chat
