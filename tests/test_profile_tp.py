"""scripts/profile_tp.py: the GPU trace reader (one table per GPU), the per-step difference of a long
and a short generation, the kinds of kernels, and a whole run on the CPU under model=2."""

import gzip
import importlib.util
import json
import os
import sys

import pytest

from jspec.errors import UsageError

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")


def load(name):
    sys.path.insert(0, SCRIPTS)
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_trace(path, events):
    with gzip.open(os.path.join(path, "host.trace.json.gz"), "wt") as fh:
        json.dump({"traceEvents": events}, fh)


def test_kernel_table_splits_the_trace_by_gpu(tmp_path):
    P = load("profile_tp")
    meta = [dict(ph="M", name="process_name", pid=pid, args=dict(name=name))
            for pid, name in ((1, "/host:CPU"), (2, "/device:GPU:0"), (3, "/device:GPU:1"), (4, "/device:GPU:10"))]
    kernels = [dict(ph="X", pid=2, name="jspec_matvec", dur=10.0), dict(ph="X", pid=2, name="jspec_matvec", dur=5.0),
               dict(ph="X", pid=3, name="psum_fusion", dur=4.0), dict(ph="X", pid=1, name="host_op", dur=99.0),
               dict(ph="X", pid=4, name="jspec_matvec", dur=1.0)]
    write_trace(tmp_path, meta + kernels)
    table = P.kernel_table(str(tmp_path))
    assert table == {0: {"jspec_matvec": [15.0, 2]}, 1: {"psum_fusion": [4.0, 1]}, 10: {"jspec_matvec": [1.0, 1]}}


def test_step_profile_is_the_long_runs_excess_by_kind():
    T = load("profile_tp")
    assert [T.kind_of(k) for k in ("jspec_matvec__7", "gemm_fusion_dot_4", "jspec_block_attention__1",
                                   "psum_469_0_fusion_1", "ncclDevKernel_AllGather_RING_LL", "loop_reduce_fusion_93",
                                   "input_add_reduce_fusion_14")] == \
        ["products", "products", "attention", "collective", "collective", "other", "other"]
    # 8 extra steps: 1.0 s more wall, per GPU 8 products of 100 µs, 16 psums of 5 µs, 8 norms of 20 µs
    short = (1.0, {0: {"jspec_matvec": [50.0, 2], "loop_reduce_fusion": [10.0, 1]}})
    long = (1.0 + 8e-3, {0: {"jspec_matvec": [850.0, 10], "psum_0_fusion": [80.0, 16],
                             "loop_reduce_fusion": [170.0, 9]}})
    row = T.step_profile(long, short, 8, top=2)
    g = row["gpus"]["0"]
    assert row["wall_ms"] == pytest.approx(1.0)
    assert g["products_ms"] == pytest.approx(0.1) and g["collective_ms"] == pytest.approx(0.01)
    assert g["other_ms"] == pytest.approx(0.02) and g["attention_ms"] == 0.0
    assert g["busy_ms"] == pytest.approx(0.13) and g["idle_ms"] == pytest.approx(0.87)
    assert g["collective_launches"] == 2.0 and [k["kernel"] for k in g["top"]] == ["jspec_matvec", "loop_reduce_fusion"]


def test_profile_tp_runs_under_model_2_on_the_cpu(tmp_path, capsys):
    T = load("profile_tp")
    T.main(["--out", str(tmp_path), "--shape", "tiny", "--batches", "1", "--new", "8"])
    rows = json.loads((tmp_path / "profile_tp.json").read_text())
    assert [(r["devices"], r["mesh"], r["batch"]) for r in rows] == [(1, None, 1), (2, "model=2", 1)]
    assert rows[1]["device_bytes"] < rows[0]["device_bytes"]
    with pytest.raises(UsageError, match="model=N with N >= 2"):
        T.main(["--out", str(tmp_path), "--mesh", "data=2"])
    with pytest.raises(UsageError, match="--variants fast: expected names from default, one_shot"):
        T.main(["--out", str(tmp_path), "--variants", "default,fast"])


def test_profile_tp_compiles_each_option_set_beside_one_device(tmp_path):
    T = load("profile_tp")
    T.main(["--out", str(tmp_path), "--shape", "tiny", "--batches", "1", "--new", "8", "--variants", "default,one_shot"])
    rows = json.loads((tmp_path / "profile_tp.json").read_text())
    assert [(r["devices"], r["variant"]) for r in rows] == [(1, None), (2, "default"), (2, "one_shot")]
    assert rows[2]["options"] == T.ALL_REDUCE_ONE_SHOT and "error" not in rows[2]
