"""generate(mesh=...) on 8 fake CPU devices: data parallelism (rows split with shard_map, one
while_loop per device) and tensor parallelism (target split over the model axis) give one
device's greedy outputs; the data-parallel program has no cross-device operation at all."""

import re

import jax
import numpy as np
import pytest

from jspec import model as M
from jspec.cli import main as cli_main
from jspec.decode import generate_ar_jit, pack_prompts
from jspec.generate import SpeculativeConfig, _data_parallel, _items, generate
from jspec.sampling import GREEDY, Sampling
from jspec.sharding import mesh_label, parse_mesh, shard_params
from jspec.speculative.drafters.ngram import NgramDrafter
from jspec.speculative.engines.chain import speculative_generate_jit
from jspec.speculative.policies import resolve_policy
from jspec.speculative.engines.tree import TreeConfig
from test_spec import CFG, _drafters

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")

MAX_NEW = 12
# 6 rows: data=4 pads them to 8; repeated fragments give prompt lookup something to find
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11, 12, 13], [20], [30, 31, 30, 31], [8, 8, 8, 9], [40, 41, 42]]
COLLECTIVES = ("all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter")


@pytest.fixture(scope="module")
def target():
    return M.init_params(CFG, jax.random.PRNGKey(0), scale=0.35)


@pytest.fixture(scope="module")
def ref(target):
    return generate(target, CFG, PROMPTS, max_new_tokens=MAX_NEW)


def _same(a, b):
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_mesh_specs_and_errors():
    assert parse_mesh(None) is None
    assert mesh_label(parse_mesh("data=4")) == "data=4,model=1"
    assert parse_mesh("model=2").devices.shape == (1, 2)
    assert parse_mesh("data=2,model=2").devices.shape == (2, 2)
    for bad, msg in [("data=0", "N >= 1"), ("rows=2", "data=N"), ("data=9", "needs 9 devices")]:
        with pytest.raises(ValueError, match=msg):
            parse_mesh(bad)
    assert cli_main(["generate", "hi", "--mesh", "data=3,model=3"]) == 2  # too few devices: before any model loads


def test_data_parallel_ar_equals_one_device_without_cross_device_ops(target, ref):
    _same(generate(target, CFG, PROMPTS, max_new_tokens=MAX_NEW, mesh="data=4"), ref)
    # Every device runs its own while_loop: the compiled program never talks to another device.
    mesh = parse_mesh("data=4")
    tokens, lens, cache_len = pack_prompts(CFG, PROMPTS[:4], MAX_NEW)
    fn = _data_parallel(generate_ar_jit, mesh, ("params",),
                        _items(dict(cfg=CFG, max_new=MAX_NEW, cache_len=cache_len, sampling=GREEDY, unroll=1)))
    hlo = fn.lower((shard_params(target, mesh),), tokens, lens, jax.random.PRNGKey(0)).compile().as_text()
    assert "while" in hlo and not [op for op in COLLECTIVES if op in hlo]


def test_data_parallel_speculative_equals_one_device(target, ref):
    chain = generate(target, CFG, PROMPTS, max_new_tokens=MAX_NEW, mesh="data=4",
                     speculative=SpeculativeConfig(drafter=NgramDrafter(), policy="heuristic", k_max=4))
    _same(chain, ref)
    assert chain.accepted.sum() > 0 and chain.target_calls.shape == (len(PROMPTS),)
    drafter, dparams = _drafters(target)["eagle"]
    tree = generate(target, CFG, PROMPTS, max_new_tokens=MAX_NEW, mesh="data=2",
                    speculative=SpeculativeConfig(drafter=drafter, drafter_params=dparams, tree=TreeConfig(top_k=3, depth=3, num_nodes=8)))
    _same(tree, ref)


def test_data_parallel_continuous_batching_equals_one_device(target, ref):
    # 6 prompts over data=2: 3 a device, one row in flight each (continuous batching per device)
    _same(generate(target, CFG, PROMPTS, max_new_tokens=MAX_NEW, mesh="data=2", batch_size=2), ref)
    chain = generate(target, CFG, PROMPTS, max_new_tokens=MAX_NEW, mesh="data=2", batch_size=2,
                     speculative=SpeculativeConfig(drafter=NgramDrafter(), policy="heuristic", k_max=4))
    _same(chain, ref)
    # tensor parallel too: every model shard runs the same queue in lockstep (model=2, and data=2 x model=2)
    _same(generate(target, CFG, PROMPTS, max_new_tokens=MAX_NEW, mesh="model=2", batch_size=2), ref)
    _same(generate(target, CFG, PROMPTS, max_new_tokens=MAX_NEW, mesh="data=2,model=2", batch_size=2,
                   speculative=SpeculativeConfig(drafter=NgramDrafter(), policy="heuristic", k_max=4)), ref)


def test_tensor_parallel_equals_one_device(target, ref):
    mesh = parse_mesh("model=2")
    _same(generate(target, CFG, PROMPTS, max_new_tokens=MAX_NEW, mesh=mesh), ref)
    drafter, dparams = _drafters(target)["eagle3"]
    _same(generate(target, CFG, PROMPTS, max_new_tokens=MAX_NEW, mesh=mesh,
                   speculative=SpeculativeConfig(drafter=drafter, drafter_params=dparams, policy="static", k_max=3)), ref)
    # The portable GSPMD path (weights placed by shard_params, no shard_map; generate() runs the
    # per-head layout instead, tests/test_tensor_parallel.py): acceptance runs sharded: the verify
    # logits come out of the vocab-split LM head, each device
    # takes the argmax over its half of the vocabulary, and only (max, index) pairs cross devices;
    # no vocab-wide array is ever gathered.
    tokens, lens, cache_len = pack_prompts(CFG, PROMPTS, MAX_NEW, 4)
    hlo = speculative_generate_jit.lower(
        shard_params(target, mesh), None, None, tokens, lens, jax.random.PRNGKey(0), tcfg=CFG, drafter=NgramDrafter(),
        policy=resolve_policy("static", 3), k_max=3, max_new=MAX_NEW, cache_len=cache_len, sampling=GREEDY,
        verify="lossless", unroll=1).compile().as_text()
    gathered = [tuple(map(int, m.group(1).split(","))) for m in re.finditer(r"= \w+\[([\d,]+)\]\S* all-gather\(", hlo)]
    assert gathered and all(CFG.vocab_size not in shape for shape in gathered), gathered


def test_sampled_shards_draw_independent_streams(target):
    # The same prompt on every row: rows 0 and 2 sit at the same place of different shards, and
    # still sample differently (each shard folds its index into the key).
    out = generate(target, CFG, [[5, 6, 7]] * 4, max_new_tokens=MAX_NEW, mesh="data=2",
                   sampling=Sampling(temperature=1.0), seed=3)
    assert (out.lengths >= 1).all() and out.row(0) != out.row(2)


class _ByteTokenizer:
    """Text -> ids inside the tiny vocab (no chat template)."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [4 + b % (CFG.vocab_size - 4) for b in text.encode()][:12]}


def test_parallel_bench_writes_rows_with_devices_and_mesh(target, tmp_path):
    import json

    from jspec.bench import parallel

    args = parallel.add_parallel_args(__import__("argparse").ArgumentParser()).parse_args(
        ["--model", "tiny", "--out-dir", str(tmp_path), "--n-prompts", "4", "--batch", "4", "--max-new-tokens", "6",
         "--dtype", "float32", "--meshes", "data", "--no-fp32-tp-check", "--weak-scaling"])
    rows = parallel.run_parallel_bench(args, resolve=lambda name, dtype: (CFG, target, _ByteTokenizer()))
    # no EAGLE-3 head for this model: the script falls back to the next method in --spec
    assert [(r["name"], r["devices"], r["mesh"]) for r in rows] == [
        ("ar", 1, ""), ("spec:ngram:heuristic", 1, ""),
        ("ar", 2, "data=2,model=1"), ("spec:ngram:heuristic", 2, "data=2,model=1")]
    assert all(r["identical_to_1_device"] == 1.0 and r["speedup_vs_1_device"] > 0 for r in rows)
    # weak scaling: each of the 2 devices gets the one-device batch
    assert [(r["batch"], r["rows_per_device"], r["n_prompts"]) for r in rows] == [(4, 4, 4)] * 2 + [(8, 4, 8)] * 2
    on_disk = json.loads((tmp_path / "parallel.json").read_text())
    assert [(r["name"], r["mesh"], r["tokens_per_s"]) for r in on_disk] == [(r["name"], r["mesh"], r["tokens_per_s"]) for r in rows]


def test_gpu_kernels_only_for_programs_that_run_whole_on_each_device(monkeypatch):
    # On a host with several GPUs a traced program may be partitioned by GSPMD (a pallas_call is
    # not), unless generate() declares it per-device: one device, or data parallelism.
    monkeypatch.delenv("JSPEC_KERNELS", raising=False)
    monkeypatch.setattr(M.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(M.jax, "local_device_count", lambda: 2)
    assert M.default_kernels() == "xla"
    with M.per_device_program():
        assert M.default_kernels() == "pallas"
        with M.per_device_program(False):  # a program GSPMD may partition (sharded weights, no shard_map)
            assert M.default_kernels() == "xla"
    monkeypatch.setattr(M.jax, "local_device_count", lambda: 1)
    assert M.default_kernels() == "pallas"
    monkeypatch.setattr(M.jax, "default_backend", lambda: "cpu")
    with M.per_device_program():
        assert M.default_kernels() == "xla"
