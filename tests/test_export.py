"""Every program lowers for TPU and for CUDA on this CPU-only host (`jax.export`, nothing compiled):
AR, the chain, the tree (whole, and the loops one batch runs after its prefill), the hybrid tree,
PEARL on one device, DiffuSpec and a head's training step, of the tiny test models.

Kernels are chosen when a program is traced, from `jax.default_backend()` (model.default_kernels,
the tree's level skipping, the chain's device loops), so each export traces as on a host of its
target: the backend reads "tpu" or "gpu". A TPU program must hold no GPU kernel (a Pallas kernel
written for Triton has no TPU lowering: the export would fail); a CUDA program on the portable path
(JSPEC_KERNELS=xla) none either, and on the default path (one GPU) its Triton kernels lower.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import model as M
from jspec.bench import programs as P
from jspec.heads import dlm as D
from jspec.heads import eagle as H
from jspec.kernels import matvec as MV
from jspec.speculative.drafters.eagle import EagleDrafter
from jspec.speculative.drafters.diffusion import DiffuSpecDrafter, fit_trigram_proxy
from jspec.speculative.drafters.hybrid import HybridDrafter
from jspec.speculative.engines.tree import TreeConfig
from jspec.train import step as S
from jspec.train.config import TrainConfig
from jspec.train.testing import numpy_params

import spec_tiny

CFG = spec_tiny.CFG
GPU_CFG = CFG.replace(head_dim=32)  # the fused attention kernel's smallest head (model.fused_attention_supported)
TREE = TreeConfig(top_k=3, depth=3, num_nodes=8, verify_sizes=(4,))
SMALL = dict(prompt_len=8, max_new=16)
GPU_KERNEL_CALLS = ("__gpu$xla.gpu.triton", "mosaic_gpu")
TRITON_OK = (jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),)


def _target(cfg):
    return numpy_params(M.init_params, cfg, scale=0.35)


def _eagle3(cfg):
    hcfg = H.HeadConfig(kind="eagle3", target=cfg, capture_layers=(0, 2, 3), draft_vocab_size=24)
    return EagleDrafter(hcfg), numpy_params(H.init_head, hcfg, seed=3, scale=0.3)


def _diffuspec(cfg, target):
    dcfg = D.DLMConfig(target=cfg, num_layers=2, mask_token_id=5, block_size=8)
    proxy = jax.tree.map(jnp.asarray, fit_trigram_proxy([[7, 9, 11, 13, 3]], cfg.vocab_size))
    return DiffuSpecDrafter(dcfg=dcfg, k_max=6, m_max=4, beam=2), {"dlm": D.init_dlm(dcfg, target), "proxy": proxy}


def _train_step(cfg):
    tc = TrainConfig(kind="eagle3", ttt_steps=2, batch_size=2, seq_len=16, steps=4, compute_dtype="float32",
                     logits_chunk=8)
    hcfg = H.default_head_config("eagle3", cfg, draft_vocab_size=cfg.vocab_size)
    trainable, fixed = H.split_trainable(numpy_params(H.init_head, hcfg, seed=1, scale=0.05))
    batch = {"tokens": jnp.zeros((2, 16), jnp.int32), "segment_ids": jnp.ones((2, 16), jnp.int32),
             "loss_mask": jnp.ones((2, 16), bool), "lengths": jnp.full((2,), 16, jnp.int32)}
    mesh = S.make_mesh(1, jax.devices()[:1])
    return P.Program("train_step", S.train_step.jitted(), (hcfg, tc, mesh, S.init_state(tc, trainable), fixed,
                                                           _target(cfg), batch), {})


def _pearl(cfg, target):
    dcfg = cfg.replace(num_layers=1)
    return P.pearl_program(target, cfg, numpy_params(M.init_params, dcfg, seed=2), dcfg, gamma=3, **SMALL)


BUILDERS = {  # name -> (target config, target params) -> Program
    "ar": lambda cfg, target: P.ar_program(target, cfg, **SMALL),
    "chain": lambda cfg, target: P.chain_program(target, cfg, *_eagle3(cfg), k_max=4, **SMALL),
    "tree": lambda cfg, target: P.tree_program(target, cfg, *_eagle3(cfg), tree=TREE, **SMALL),
    "hybrid": lambda cfg, target: P.tree_program(target, cfg, HybridDrafter(_eagle3(cfg)[0]), _eagle3(cfg)[1],
                                                 tree=dataclasses.replace(TREE, ngram=3), name="hybrid", **SMALL),
    # what one batch runs after its prefill: the loops prompt widths share (generate's two-program path)
    "ar-loop": lambda cfg, target: P.ar_loop_program(target, cfg, **SMALL),
    "chain-loop": lambda cfg, target: P.chain_loop_program(target, cfg, *_eagle3(cfg), k_max=4, **SMALL),
    "tree-loop": lambda cfg, target: P.tree_loop_program(target, cfg, *_eagle3(cfg), tree=TREE, **SMALL),
    "pearl": _pearl,
    "diffuspec": lambda cfg, target: P.chain_program(target, cfg, *_diffuspec(cfg, target), policy="adl", k_max=6,
                                                     name="diffuspec", **SMALL),
    "train_step": lambda cfg, target: _train_step(cfg),
}
NAMES = tuple(BUILDERS)


@functools.cache
def program(name: str, cfg=CFG) -> P.Program:
    """The program `name` of the tiny models of target `cfg`, with abstract arguments (shapes only)."""
    p = BUILDERS[name](cfg, _target(cfg))
    return dataclasses.replace(p, args=_abstract_arrays(p.args))


def _abstract_arrays(args):
    return tuple(P.abstract(a) if _is_array_tree(a) else a for a in args)


def _is_array_tree(x) -> bool:
    leaves = jax.tree.leaves(x)
    return bool(leaves) and all(isinstance(v, (jax.Array, np.ndarray)) for v in leaves)


@pytest.fixture
def traced_as_on(monkeypatch):
    """Trace as a host of `backend` would ("tpu" or "gpu"), one program at a time; the traces are
    dropped afterwards (a GPU program's must never serve a CPU call of the same shapes)."""

    def on(backend):
        monkeypatch.setattr(jax, "default_backend", lambda: backend)
        jax.clear_caches()

    yield on
    monkeypatch.undo()
    jax.clear_caches()


def gpu_kernel_calls(module_text: str) -> set[str]:
    return {target for target in re.findall(r"custom_call @([\w$.]+)", module_text)
            if any(k in target for k in GPU_KERNEL_CALLS)}


@pytest.mark.parametrize("name", NAMES)
def test_lowers_for_tpu(name, traced_as_on):
    traced_as_on("tpu")
    exported = program(name).export(("tpu",))
    assert exported.platforms == ("tpu",)
    assert not gpu_kernel_calls(exported.mlir_module())


@pytest.mark.parametrize("name", NAMES)
def test_lowers_for_cuda_on_the_portable_path(name, traced_as_on, monkeypatch):
    monkeypatch.setenv("JSPEC_KERNELS", "xla")
    traced_as_on("gpu")
    exported = program(name).export(("cuda",))
    assert not gpu_kernel_calls(exported.mlir_module())


GPU_KERNELS = {  # the Pallas kernels each program runs on one GPU (the training step: XLA's, whole sequences)
    "ar": {"jspec_block_attention", "jspec_matvec"},
    "chain": {"jspec_block_attention", "jspec_matvec"},
    "tree": {"jspec_block_attention", "jspec_matvec"},
    "hybrid": {"jspec_block_attention", "jspec_matvec"},
    "pearl": {"jspec_block_attention", "jspec_matvec"},
    "diffuspec": {"jspec_block_attention", "jspec_matvec", "jspec_cps_search"},
}


@pytest.mark.parametrize("name", GPU_KERNELS)
def test_gpu_kernels_lower_for_cuda(name, traced_as_on):
    """One GPU: the Pallas kernels lower to Triton (not compiled: that needs the GPU) inside the
    same generation loop."""
    traced_as_on("gpu")
    with M.per_device_program():
        text = program(name, GPU_CFG).export(("cuda",), disabled_checks=TRITON_OK).mlir_module()
    assert gpu_kernel_calls(text) == {"__gpu$xla.gpu.triton"}
    assert set(re.findall(r"(jspec_\w+?)/pallas_call", text)) == GPU_KERNELS[name]


def test_a_gpu_kernel_has_no_tpu_lowering():
    """Why the TPU programs above must choose the portable path: a kernel written for Triton fails
    to lower for TPU (loudly: never a wrong program)."""
    x, w = jax.ShapeDtypeStruct((1, 64), jnp.float32), jax.ShapeDtypeStruct((64, 128), jnp.float32)
    kernel = jax.jit(lambda x, w: MV.matvec(x, w, blocks=MV.Blocks(64, 64, 1, 4, 2)))
    with pytest.raises(ValueError, match="cannot be used for tpu lowering"):
        jax.export.export(kernel, platforms=("tpu",))(x, w)


@pytest.mark.parametrize("name", ("ar", "tree"))
def test_gpu_kernels_lower_once_per_shape_not_once_per_layer(name, traced_as_on):
    """Each kernel launch is a program of its own (kernels/*.py `_kernel_call`), so a forward's
    layers share one traced and lowered Triton kernel per shape: the module holds as many kernels
    at twice the depth, and lowering time does not grow with the layer count."""
    counts = []
    for layers in (GPU_CFG.num_layers, 2 * GPU_CFG.num_layers):
        traced_as_on("gpu")
        with M.per_device_program():
            text = program(name, GPU_CFG.replace(num_layers=layers)).export(
                ("cuda",), disabled_checks=TRITON_OK).mlir_module()
        counts.append(len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)))
    assert counts[0] == counts[1], counts
