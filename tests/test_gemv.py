"""The CUDA few-row product kernel (jspec/kernels/gemv.py): its block rule, errors and fallbacks on
every machine; that its source compiles where nvcc is; its products against XLA's on a GPU."""

import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.kernels import cuda_build
from jspec.kernels import gemv as GV
from jspec.kernels import matvec as MV


def test_default_blocks_fill_the_card_and_keep_a_step_per_thread_row():
    for K, N in ((2048, 16384), (8192, 2048), (2048, 3072), (2048, 2048), (576, 576), (14336, 4096)):
        bn, split = GV.default_blocks(K, N, transposed=False, sms=132)
        GV.check_blocks((bn, split), transposed=False)
        rows_per_step = (GV.THREADS // (bn // 8)) * GV.UNROLL
        assert split == 1 or K // split >= rows_per_step
        assert -(-N // bn) * split >= 2 * 132 or bn == GV.BLOCK_NS[0] or split == GV.MAX_SPLIT or K // (2 * split) < rows_per_step
    assert GV.default_blocks(2048, 128256, transposed=True) == (0, 1)
    assert GV.default_blocks(2048, 16384, transposed=False, sms=132) == (256, 8)  # 64 column blocks, 8-way split


def test_candidates_are_valid_blocks():
    for b in GV.candidate_blocks(2048, 16384, transposed=False):
        GV.check_blocks(b, transposed=False)
    assert GV.candidate_blocks(2048, 128256, transposed=True) == [(0, 1)]


def test_bad_blocks_are_one_line_errors():
    with pytest.raises(ValueError, match="block_n one of"):
        GV.check_blocks((96, 1), transposed=False)
    with pytest.raises(ValueError, match="split 1-8"):
        GV.check_blocks((64, 16), transposed=False)
    with pytest.raises(ValueError, match="one block shape"):
        GV.check_blocks((64, 1), transposed=True)


def test_off_a_sm90_gpu_nothing_is_routed_to_it(monkeypatch):
    if jax.default_backend() != "gpu":
        assert not GV.available()
    monkeypatch.setenv("JSPEC_MATMUL", "cuda")
    assert not MV.use_cuda_kernel(1, 2048, 2048, transposed=False, w_dtype=jnp.bfloat16, x_dtype=jnp.bfloat16) \
        or GV.available()
    # what it never takes: float32, more than 8 rows, a contiguous dimension not a multiple of 8
    assert not GV.serves(1, 64, 64, transposed=False, w_dtype=jnp.float32, x_dtype=jnp.float32)
    assert not GV.serves(9, 64, 64, transposed=False, w_dtype=jnp.bfloat16, x_dtype=jnp.bfloat16)
    assert not GV.serves(1, 64, 60, transposed=False, w_dtype=jnp.bfloat16, x_dtype=jnp.bfloat16)


def test_matmul_choice_names_the_choices(monkeypatch):
    monkeypatch.setenv("JSPEC_MATMUL", "gpu")
    with pytest.raises(ValueError, match="auto, matvec, cuda, xla"):
        MV.matmul_choice()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_source_compiles(tmp_path):
    out = tmp_path / "gemv.so"
    run = subprocess.run(cuda_build.build_command(GV.SOURCE, out, arch="sm_90"), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "JspecGemv" in subprocess.run(["nm", "-D", str(out)], capture_output=True, text=True).stdout


@pytest.mark.skipif(not GV.available(), reason="needs an sm_90+ GPU and nvcc")
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_products_match_xla_on_a_gpu(transposed, M):
    K, N, L = 1024, 1536, 3
    w = (0.05 * jax.random.normal(jax.random.PRNGKey(0), (L, N, K) if transposed else (L, K, N))).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.PRNGKey(1), (M, K)).astype(jnp.bfloat16)
    for blocks in GV.candidate_blocks(K, N, transposed=transposed):
        got = GV.gemv(x, w, layer=jnp.int32(2), transposed=transposed, out_dtype=jnp.float32, blocks=blocks)
        ref = jnp.dot(x, w[2].T if transposed else w[2], preferred_element_type=jnp.float32)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-3, atol=2e-3)
        # a row's result does not depend on how many rows share the call
        one = GV.gemv(x[:1], w, layer=jnp.int32(2), transposed=transposed, out_dtype=jnp.float32, blocks=blocks)
        assert np.array_equal(np.asarray(one)[0], np.asarray(got)[0])
