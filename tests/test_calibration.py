"""`jspec calibrate` end to end on the tiny target and EAGLE-3 head: recorded rounds replay the
engine's own draft lengths, every calibrated policy fits at least as well as its paper constants,
the fit lands in the user cache (the fits shipped beside a head, jspec/calibration.json, are only
read) and policy specs find this card's (`svip`, `svip:paper`, `svip:calibrated`), and calibrated
policies stay greedy-identical to AR."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from jspec import cli, tasks
from jspec.bench import calibrate as C
from jspec.checkpoint.eagle_format import EXTRAS_DIR, save_eagle_head
from jspec.generate import SpeculativeConfig, generate
from jspec.speculative.drafters.base import DrafterError
from jspec.speculative.factory import resolve_policy_spec
from jspec.speculative.policies import make_policy
from jspec.speculative.policies.auto import REFERENCE_COSTS
from jspec.speculative.policies.calibration import (CALIBRATED_POLICIES, CALIBRATION_GRIDS, Records, RoundCost, calibration_path,
                                                    fit_all, replay, user_calibration_path)
from jspec.speculative.policies.ldlp import init_ldlp, save_ldlp
from spec_tiny import CFG, _drafters, _prompts, make_target

K = 4


@pytest.fixture(scope="module")
def setup():
    target = make_target()
    drafter, dparams = _drafters(target)["eagle3"]
    ldlp = init_ldlp(CFG.hidden_size, jax.random.PRNGKey(5), hidden=16)
    prompts = _prompts(0, batch=3) + _prompts(1, batch=3)
    records = C.record_rounds(target, CFG, drafter, dparams, prompts, k_max=K, batch=3, max_new=24, ldlp_params=ldlp)
    return target, drafter, dparams, ldlp, prompts, records


def test_recorded_rounds_replay_the_engines_draft_lengths(setup):
    target, drafter, dparams, _, prompts, rec = setup
    assert rec.stats.shape[:3] == (6, 24, K) and rec.n_rounds > 6 and rec.has_predictions
    live = np.arange(rec.drafted.shape[1])[None] < rec.rounds[:, None]
    st = rec.stats[live]
    assert (st[..., 0] >= 0).all() and (st[..., 1] >= st[..., 2]).all() and (st[..., 3] <= 0).all()
    assert (rec.accepted[live] <= rec.drafted[live]).all() and (rec.drafted[live] <= K).all()
    # a round's context is the engine's own only in the first round: there the replayed max-confidence
    # rule drafts exactly what the engine drafted
    first = dataclasses.replace(rec, rounds=np.minimum(rec.rounds, 1))
    cost = RoundCost.from_table(REFERENCE_COSTS, 1, K)
    for threshold in (0.3, 0.6):
        policy = make_policy("confidence", k_max=K, threshold=threshold)
        res = generate(target, CFG, prompts, max_new_tokens=24,
                       speculative=SpeculativeConfig(drafter=drafter, drafter_params=dparams, policy=policy, k_max=K))
        assert int(replay(policy, first, K, cost)["drafted"]) == int(res.draft_lengths[:, 1].sum())


def test_calibration_fits_every_policy_and_specs_find_it(setup, tmp_path):
    target, drafter, dparams, ldlp, prompts, rec = setup
    cost = RoundCost.from_table(REFERENCE_COSTS, 1, K)
    fits = fit_all(list(CALIBRATED_POLICIES), rec, K, cost)
    assert set(fits["static"]) == {str(k) for k in range(1, K + 1)}
    for name, fit in fits["policies"].items():
        for key, grid in CALIBRATION_GRIDS[name].items():
            assert fit["constants"][key] in grid
        if name != "tapout":  # the paper's constants are grid points: the fit can only be as fast or faster
            assert fit["calibrated"]["speedup_vs_ar"] >= fit["paper"]["speedup_vs_ar"] - 1e-6
    assert set(fits["policies"]["tapout"]["constants"]) >= {"svip", "adaedl"}
    # the oracle stop rule (drafts exactly what each round accepted) bounds every policy and static K
    ceiling = fits["oracle"]["speedup_vs_ar"]
    assert all(ceiling >= f["calibrated"]["speedup_vs_ar"] - 1e-6 for f in fits["policies"].values())
    assert all(ceiling >= s["speedup_vs_ar"] - 1e-6 for s in fits["static"].values())
    assert fits["oracle"]["tokens_per_round"] == pytest.approx(fits["static"][str(K)]["tokens_per_round"])

    head = tmp_path / "eagle3"
    save_eagle_head(str(head), drafter.head, dparams)
    spec = f"eagle3:{head}"
    with pytest.raises(DrafterError, match="jspec calibrate"):
        resolve_policy_spec("svip:calibrated", spec, None, K)
    policy, constants = resolve_policy_spec("svip", spec, None, K)
    assert policy == "svip" and constants.startswith("the paper's constants (no `jspec calibrate` fit")  # built later
    entry = {"k_max": K, "rounds": 40, "policies": fits["policies"]}
    from jspec.cards import card_key
    from jspec.speculative.policies.calibration import save_calibration

    # another card's fit is not this card's: svip runs the paper's, svip:calibrated is an error
    save_calibration(calibration_path(head), "another_card", entry)
    assert resolve_policy_spec("svip", spec, None, K)[0] == "svip"
    with pytest.raises(DrafterError, match=f"no svip fit for head {head} on {card_key()}"):
        resolve_policy_spec("svip:calibrated", spec, None, K)
    assert save_calibration(calibration_path(head), card_key(), entry) == head / "jspec" / "calibration.json"
    svip, constants = resolve_policy_spec("svip", spec, None, K)
    assert svip.threshold == fits["policies"]["svip"]["constants"]["threshold"] and svip.k_max == K
    assert constants == f"calibrated on {card_key()} from 40 recorded rounds ({calibration_path(head)})"
    assert resolve_policy_spec("svip:paper", spec, None, K) == (make_policy("svip", k_max=K), "the paper's constants (:paper)")
    tapout = resolve_policy_spec("tapout:calibrated", spec, None, K)[0]
    assert tapout.svip.threshold == fits["policies"]["svip"]["constants"]["threshold"]
    ldlp_policy = resolve_policy_spec("ldlp", spec, None, K)[0]
    assert ldlp_policy.length_offset == fits["policies"]["ldlp"]["constants"]["length_offset"]
    # a user's fit (the user cache, `jspec calibrate`'s default) comes before the one shipped beside the head
    mine = {"k_max": K, "policies": {"svip": {**fits["policies"]["svip"], "constants": {"threshold": 0.05}}}}
    user = save_calibration(user_calibration_path(head), card_key(), mine)
    assert resolve_policy_spec("svip", spec, None, K)[0].threshold == 0.05
    user.unlink()
    # a fit recorded with other weights (the head retrained in place) is not used for this head
    from jspec.speculative.policies.calibration import head_fingerprint

    own = head_fingerprint(head)
    assert own is not None and len(own) == 16
    stale = {"k_max": K, "policies": {"svip": {**fits["policies"]["svip"], "head": "0" * 16}}}
    save_calibration(calibration_path(head), card_key(), stale)
    with pytest.warns(UserWarning, match="other head weights"):
        assert resolve_policy_spec("svip", spec, None, K)[0] == "svip"
    save_calibration(calibration_path(head), card_key(),
                     {"k_max": K, "policies": {"svip": {**fits["policies"]["svip"], "head": own}}})
    assert resolve_policy_spec("svip", spec, None, K)[0] == svip
    ar = generate(target, CFG, prompts, max_new_tokens=16)
    for policy, params in ((tapout, None), (ldlp_policy, ldlp), (resolve_policy_spec("adaedl", spec, None, K)[0], None)):
        out = generate(target, CFG, prompts, max_new_tokens=16, speculative=SpeculativeConfig(
            drafter=drafter, drafter_params=dparams, policy=policy, policy_params=params, k_max=K))
        assert all(out.row(b) == ar.row(b) for b in range(len(prompts)))


class ShortTokenizer:
    chat_template = None

    def __call__(self, text):
        return {"input_ids": [4 + ord(c) % 40 for c in text[:20]]}


@pytest.fixture
def no_evaluation_sets(monkeypatch):
    """Every evaluation set jspec.tasks can read (MT-Bench, HumanEval, longdoc, chitchat's held-out
    conversations) raises when read; the training split and a user's own questions file still load."""
    def refuse(name):
        def read(*args, **kwargs):
            raise AssertionError(f"read the evaluation set {name}")
        return read

    for name in ("mt_bench_file", "humaneval_file", "_load_humaneval", "_load_chitchat", "_load_longdoc", "_module_document"):
        monkeypatch.setattr(tasks, name, refuse(name))
    for task in tasks.TASK_NAMES:
        monkeypatch.setitem(tasks._TASK_LOADERS, task, refuse(task))


def test_calibrate_reads_no_evaluation_set_unless_given_one(no_evaluation_sets, tmp_path, monkeypatch):
    """calibrate's prompts: chitchat's training split by default, the user's file when given one
    (which may be anything, an evaluation set included: their choice), and the training split never
    holds a turn of a held-out conversation (every CHITCHAT_HOLDOUT_EVERY-th, which the chitchat
    task evaluates on)."""
    parse = lambda *argv: C.add_calibrate_args(__import__("argparse").ArgumentParser()).parse_args(list(argv))  # noqa: E731
    conversations = tuple((f"c{i}", tuple(f"conversation {i} turn {t} says something long enough" for t in range(2)))
                          for i in range(30))
    monkeypatch.setattr(tasks, "_chitchat_conversations", lambda: conversations)
    held_out = {turn for i, (_, turns) in enumerate(conversations) if i % tasks.CHITCHAT_HOLDOUT_EVERY == 0 for turn in turns}
    training = {turn for _, turns in conversations for turn in turns} - held_out
    texts, note = C.calibration_prompts(parse("--n-prompts", str(len(training))))  # the whole training split
    assert set(texts) == training and "training split" in note
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"question_id": 1, "turns": ["my own question"]}) + "\n")
    assert C.calibration_prompts(parse("--prompt-file", str(path)))[0] == ["my own question"]


def test_calibrate_command_writes_to_the_user_cache(setup, tmp_path, monkeypatch, capsys, no_evaluation_sets):
    """`jspec calibrate` writes its fits to the user cache, never into the head's folder (a
    repository's shipped fits are only read) unless --out-dir names it; with timed rounds it
    measures no cost table."""
    target, drafter, dparams, ldlp, _, _ = setup
    head = tmp_path / "eagle3"
    save_eagle_head(str(head), drafter.head, dparams)
    save_ldlp(str(head / EXTRAS_DIR), ldlp, {"d_model": CFG.hidden_size, "hidden": 16})  # where engines never look
    monkeypatch.setattr(C.presets, "resolve_model", lambda *a, **k: (CFG, target, ShortTokenizer()))
    measured = []
    monkeypatch.setattr(C, "ensure_costs", lambda *a, **k: measured.append(1) or REFERENCE_COSTS)  # the round-cost tests time
    argv = ["calibrate", "--model", "tiny", "--drafter", f"eagle3:{head}", "--policy", "svip,ldlp", "--k-max", str(K),
            "--n-prompts", "6", "--record-batch", "3", "--max-new-tokens", "12"]
    assert cli.main([*argv, "--temperatures", "0.7"]) == 0
    out = capsys.readouterr().out
    assert "svip calibrated" in out and "static K=4" in out and "oracle stop" in out
    assert not calibration_path(head).exists() and not measured and f"calibration: {user_calibration_path(head)}" in out
    assert "calibrate: timing plain decoding and static chains" in out and "calibrate: recording static K = 4" in out
    data = json.loads(user_calibration_path(head).read_text())
    (entry,) = data["cards"].values()
    assert set(entry["policies"]) == {"svip", "ldlp"} and entry["k_max"] == K and "training split" in entry["prompts"]
    from jspec.cards import card_key
    from jspec.speculative.policies.calibration import head_fingerprint

    assert {fit["head"] for fit in entry["policies"].values()} == {head_fingerprint(head)}
    # the recorded acceptance (greedy, and sampled with --temperatures) is what `auto` plans this head with
    from jspec.speculative.factory import build_drafter

    recorded = build_drafter(f"eagle3:{head}", CFG, target)[0]
    assert recorded.acceptance == entry["acceptance"]["alpha"]
    assert recorded.acceptance_by_temperature == ((0.7, entry["acceptance"]["by_temperature"]["0.7"]),)
    rc = entry["round_cost"]  # timed here unless the CPU's timings gave no positive draft step
    assert rc["source"].startswith("timed here") or "timing too noisy" in rc["source"], rc
    assert "round cost: " in out
    assert cli.main([*argv, "--out-dir", str(head), "--round-cost", "table"]) == 0  # a head's own (shipped) fits
    assert set(json.loads(calibration_path(head).read_text())["cards"][card_key()]["policies"]) == {"svip", "ldlp"}
    assert measured and "round cost: cost table" in capsys.readouterr().out
    # without --policy a head with no LDLP predictor yet (freshly trained) gets every other fit
    bare = tmp_path / "bare"
    save_eagle_head(str(bare), drafter.head, dparams)
    assert user_calibration_path(bare) == user_calibration_path(head)  # the same weights: the same fits
    user_calibration_path(head).unlink()
    assert cli.main(["calibrate", "--model", "tiny", "--drafter", f"eagle3:{bare}", *argv[7:], "--round-cost", "table"]) == 0
    assert "ldlp is not fit" in capsys.readouterr().out
    (entry,) = json.loads(user_calibration_path(bare).read_text())["cards"].values()
    assert set(entry["policies"]) == set(CALIBRATED_POLICIES) - {"ldlp"}
    assert entry["round_cost"]["source"].startswith("cost table")
    assert cli.main(["calibrate", "--policy", "static"]) == 2
    assert "calibrate fits confidence, svip" in capsys.readouterr().err


def test_calibrate_a_draft_model_keeps_its_fits_per_target(setup, tmp_path, monkeypatch, capsys, no_evaluation_sets):
    """`jspec calibrate --drafter model:PATH` records and fits a draft model's chains as an EAGLE
    head's; its fits are kept per target (one draft model may serve several), found by `svip` for
    that target only, and the calibrated rule stays greedy-identical to AR."""
    from jspec.cards import card_key
    from jspec.checkpoint.draft_format import save_draft_model
    from jspec.speculative.factory import calibration_home
    from jspec.speculative.policies.calibration import calibrated_constants, head_fingerprint

    target, *_ = setup
    drafter, dparams = _drafters(target)["model"]
    draft = tmp_path / "draft"
    save_draft_model(str(draft), drafter.cfg, dparams, CFG, (0,), dtype="float32")
    spec = f"model:{draft}"
    assert calibration_home(spec, "tiny") == (draft, "tiny") and calibration_home("ngram", "tiny") == (None, None)
    monkeypatch.setattr(C.presets, "resolve_model", lambda *a, **k: (CFG, target, ShortTokenizer()))
    argv = ["calibrate", "--model", "tiny", "--drafter", spec, "--k-max", str(K), "--n-prompts", "6",
            "--record-batch", "3", "--max-new-tokens", "12", "--round-cost", "table", "--temperatures", "1"]
    monkeypatch.setattr(C, "ensure_costs", lambda *a, **k: REFERENCE_COSTS)
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "a draft model has no LDLP predictor" in out and "svip calibrated" in out
    path = user_calibration_path(draft, "tiny")
    assert path.name == f"{head_fingerprint(draft)}-tiny.json" and f"calibration: {path}" in out
    (entry,) = json.loads(path.read_text())["cards"].values()
    assert set(entry["policies"]) == set(CALIBRATED_POLICIES) - {"ldlp"} and entry["target"] == "tiny"
    # the recorded per-token acceptance is what `auto` plans this pair with, for this target only
    from jspec.speculative.factory import build_drafter

    alpha, sampled = entry["acceptance"]["alpha"], entry["acceptance"]["by_temperature"]["1"]
    assert 0.0 <= alpha <= 1.0 and 0.0 <= sampled <= 1.0 and "per-token acceptance (what `auto` plans with)" in out
    pair = build_drafter(spec, CFG, target, model_name="tiny")[0]
    assert pair.acceptance == alpha and pair.acceptance_by_temperature == ((1.0, sampled),)
    other = build_drafter(spec, CFG, target, model_name="other-target")[0]
    assert other.acceptance is None and other.acceptance_by_temperature is None
    svip, constants = resolve_policy_spec("svip", spec, "tiny", K)
    assert svip.threshold == entry["policies"]["svip"]["constants"]["threshold"] and constants.startswith("calibrated on")
    # another target's policies never read this pair's fits
    assert calibrated_constants(draft, "svip", card_key(), "other-target") is None
    policy, constants = resolve_policy_spec("svip", spec, "other-target", K)
    assert policy == "svip" and "no `jspec calibrate` fit for this draft model" in constants
    with pytest.raises(DrafterError, match="draft model \\(for target other-target\\)"):
        resolve_policy_spec("svip:calibrated", spec, "other-target", K)
    assert cli.main([*argv[:-1], "0.7,0"]) == 2 and "--temperatures: '0' is not a temperature above 0" in capsys.readouterr().err
    # --out-dir: the file a draft model's folder ships, one per target
    assert cli.main([*argv, "--policy", "confidence", "--out-dir", str(draft)]) == 0
    assert (draft / "jspec" / "calibration-tiny.json").is_file() and not (draft / "jspec" / "calibration.json").exists()
    ar = generate(target, CFG, _prompts(2), max_new_tokens=16)
    out = generate(target, CFG, _prompts(2), max_new_tokens=16, speculative=SpeculativeConfig(
        drafter=drafter, drafter_params=dparams, policy=svip, k_max=K))
    assert all(out.row(b) == ar.row(b) for b in range(3))


def test_recorded_acceptance_is_the_geometric_fit():
    """Accepted drafts over accepted drafts plus first rejections; a round that accepted all it
    drafted shows no rejection, and rounds past a row's last are not counted."""
    from jspec.speculative.policies.calibration import recorded_acceptance

    drafted = np.array([[4, 4, 4], [4, 2, 4]])
    accepted = np.array([[4, 1, 0], [2, 2, 4]])  # row 1's third round is past its last
    rec = Records(np.zeros((2, 3, 4, 4)), drafted, accepted, np.zeros((2, 3)), np.array([3, 2]))
    assert recorded_acceptance(rec) == pytest.approx(9 / (9 + 3))


def test_a_preset_folder_is_fingerprinted_by_its_pinned_hash(tmp_path):
    """A draft model assembled from packages has no weight files in its preset folder: its fits
    are keyed by the preset's pinned SHA-256; a single weights file (a GGUF) by its own bytes."""
    from jspec.speculative.policies.calibration import head_fingerprint, target_tag

    (tmp_path / "preset.json").write_text(json.dumps({"source": {"sha256": "ab" * 32}}))
    assert head_fingerprint(tmp_path) == "ab" * 8
    gguf = tmp_path / "draft.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    assert head_fingerprint(gguf) is not None and head_fingerprint(gguf) != head_fingerprint(tmp_path)
    assert head_fingerprint(tmp_path / "missing") is None
    assert target_tag("qwen2.5-coder-1.5b-instruct") == "qwen2.5-coder-1.5b-instruct"
    tag = target_tag("/ckpt/my model")
    assert tag.startswith("my_model-") and len(tag) == len("my_model-") + 8 and tag != target_tag("/other/my model")


def test_calibration_prompts_from_a_questions_file(tmp_path):
    """--prompt-file: a user's own workload (bench --questions' format), all of it or its first
    --n-prompts; a missing file or too large a count is a one-line usage error before any loading."""
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "category": "x", "turns": [f"q{i}", "again"]}) + "\n"
                            for i in range(5)))
    args = lambda **kw: C.add_calibrate_args(__import__("argparse").ArgumentParser()).parse_args(  # noqa: E731
        [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])
    texts, note = C.calibration_prompts(args(prompt_file=path))
    assert texts == [f"q{i}" for i in range(5)] and "first 5 of 5" in note
    assert C.calibration_prompts(args(prompt_file=path, n_prompts=2))[0] == ["q0", "q1"]
    with pytest.raises(C.UsageError, match="holds 5 questions"):
        C.calibration_prompts(args(prompt_file=path, n_prompts=9))
    with pytest.raises(C.UsageError, match="does not exist"):
        C.calibration_prompts(args(prompt_file=tmp_path / "none.jsonl"))


def test_one_card_name_for_rows_and_one_key_for_files(monkeypatch):
    """Rows and the matvec table name the card as JAX does; files and calibration entries use the
    same name with underscores (jspec.cards), so a fit and its cost table find each other."""
    from jspec import cards

    class H200:
        platform, device_kind = "gpu", "NVIDIA H200"

    monkeypatch.setattr(cards.jax, "devices", lambda: [H200()])
    assert cards.card_name() == "NVIDIA H200" and cards.card_key() == "NVIDIA_H200"
    from jspec.speculative.policies.auto import cost_table_path

    assert cost_table_path("smollm2-135m-instruct").name == "round_cost_NVIDIA_H200.json"
    monkeypatch.undo()
    assert cards.card_name() == cards.card_key() == "cpu"


def test_replay_charges_the_draft_step_a_stop_drops():
    """AdaEDL's dropped token was computed: its draft forward is paid for (it used not to be,
    which flattered the paper rule's fit); kept, the same forward buys a token that may be accepted."""
    N, R = 2, 3
    stats = np.zeros((N, R, K, 4), np.float32)
    stats[..., 0] = 2.0  # every step's entropy high: AdaEDL (lambda 1.5) stops at step 1, the first it checks
    rec = Records(stats=stats, drafted=np.full((N, R), K, np.int32), accepted=np.full((N, R), K, np.int32),
                  rounds=np.full((N,), R, np.int32), predicted=None)
    cost = RoundCost(fixed_us=100.0, step_us=10.0, verify_us=tuple(1000.0 + k for k in range(K + 1)))
    from jspec.speculative.policies.calibration import replay

    for keep, drafted in ((False, 1), (True, 2)):
        pol = make_policy("adaedl", k_max=K, lambda_init=1.5, step=0.0, keep_checked_token=keep)
        out = {k: float(v) for k, v in replay(pol, rec, K, cost).items()}
        assert out["drafted"] == N * R * drafted and out["tokens"] == N * R * (drafted + 1)
        assert out["us"] == N * R * (100.0 + 2 * 10.0 + 1000.0 + K)  # two draft forwards either way


def test_timed_round_cost_takes_the_draft_step_from_the_timed_chains():
    """Static chains drafting 2 and 8 of one block, timed at 1,065 and 1,233 µs a round: a 28 µs draft
    step, whatever the table says the step costs alone, and the rest of the round such that the
    replay reproduces both timings; plain decoding's timed step becomes the AR reference."""
    from jspec.speculative.policies.calibration import RoundCost

    table = RoundCost(40.0, 62.0, tuple(900.0 + 2 * k for k in range(9)))
    cost = RoundCost.timed(table, 8, {2: 1065.0, 8: 1233.0}, ar_us=990.0)
    assert cost.step_us == pytest.approx(28.0) and cost.ar_us == 990.0
    for L, us in ((2, 1065.0), (8, 1233.0)):
        assert cost.fixed_us + L * cost.step_us + cost.verify_us[8] == pytest.approx(us)
    assert cost.verify_us[1:] == table.verify_us[1:]
    with pytest.raises(ValueError, match="draft step"):
        RoundCost.timed(table, 8, {2: 1100.0, 8: 1090.0}, ar_us=990.0)



def test_auto_runs_the_calibrated_stop_rule_in_batch_one_greedy_chains(setup, tmp_path):
    """`auto`'s batch-1 greedy chain runs the drafter's best calibrated stop rule where the replay on
    this card puts it STOP_RULE_MARGIN above the best static K; trees, several rows, sampling, a
    fit at another batch or a rule that replays too close to static K keep the plan. The plan runs
    exactly what the rule runs by name."""
    from jspec.cards import card_key
    from jspec.sampling import Sampling
    from jspec.speculative.factory import with_calibrated_stop_rule
    from jspec.speculative.policies.auto import AutoPlan
    from jspec.speculative.policies.calibration import STOP_RULE_MARGIN, save_calibration

    target, drafter, dparams, _, prompts, rec = setup
    head = tmp_path / "eagle3"
    save_eagle_head(str(head), drafter.head, dparams)
    spec = f"eagle3:{head}"
    fits = fit_all(["confidence", "svip"], rec, K, RoundCost.from_table(REFERENCE_COSTS, 1, K))["policies"]

    def entry(confidence_gain, batch=1):
        policies = {name: {**fit, "calibrated": {**fit["calibrated"], "speedup_vs_ar": gain}}
                    for (name, fit), gain in ((("confidence", fits["confidence"]), confidence_gain), (("svip", fits["svip"]), 1.0))}
        return {"k_max": K, "batch": batch, "rounds": 40, "policies": policies,
                "static": {"1": {"speedup_vs_ar": 1.0}, "2": {"speedup_vs_ar": 1.2}}}

    chain = AutoPlan(mode="chain", k_max=2, num_nodes=0, gain=1.2, policy=make_policy("auto", k_max=K))
    plan = lambda p=chain, **kw: with_calibrated_stop_rule(p, spec, None, **{"batch": 1, "k_cap": K, **kw})
    assert plan() is chain  # no fit on this card
    save_calibration(calibration_path(head), card_key(), entry(1.2 * (STOP_RULE_MARGIN + 0.05)))
    ruled = plan()
    expected = resolve_policy_spec("confidence", spec, None, K)[0]
    assert ruled.stop_rule == expected and ruled.k_max == K and ruled.describe().startswith(f"chain K <= {K}, confidence stop rule")
    tree = dataclasses.replace(chain, mode="tree", num_nodes=15)
    assert plan(batch=4) is chain and plan(sampling=Sampling(temperature=1.0)) is chain and plan(tree) is tree
    assert plan(sampling=Sampling()) == ruled  # greedy Sampling: as None
    assert with_calibrated_stop_rule(chain, f"{spec}+ngram", None, batch=1, k_cap=K) is chain  # hybrids keep their plan
    save_calibration(calibration_path(head), card_key(), entry(1.2 * (STOP_RULE_MARGIN - 0.02)))
    assert plan() is chain
    save_calibration(calibration_path(head), card_key(), entry(2.0, batch=16))
    assert plan() is chain
    # the plan runs what the rule runs by name, lossless
    run = lambda policy: generate(target, CFG, prompts[:2], max_new_tokens=16, speculative=SpeculativeConfig(
        drafter=drafter, drafter_params=dparams, policy=policy, k_max=K))
    by_plan, by_name, ar = run(ruled), run(expected), generate(target, CFG, prompts[:2], max_new_tokens=16)
    assert np.array_equal(by_plan.draft_lengths, by_name.draft_lengths)
    assert all(by_plan.row(b) == ar.row(b) for b in range(2))


def test_shipped_fits_make_auto_run_the_confidence_rule_where_it_was_timed_ahead():
    """The fits shipped with the presets pick, on the cards they were made for, the rule whose
    same-process rows ran ahead of `auto`'s own chain lengths (BENCHMARKS.md): confidence."""
    from jspec.presets import models_dir
    from jspec.speculative.policies.calibration import STOP_RULE_MARGIN, best_stop_rule

    pair = best_stop_rule(models_dir() / "qwen2.5-coder-0.5b-instruct", "NVIDIA_H100_80GB_HBM3", "qwen2.5-coder-1.5b-instruct")
    head = best_stop_rule(models_dir() / "smollm2-135m-instruct" / "heads" / "eagle3", "NVIDIA_H200")
    for name, fit, gain in (pair, head):
        assert name == "confidence" and gain >= STOP_RULE_MARGIN and "threshold" in fit.constants
    assert best_stop_rule(models_dir() / "qwen2.5-coder-0.5b-instruct", "cpu", "qwen2.5-coder-1.5b-instruct") is None
