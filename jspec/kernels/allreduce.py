"""Tensor parallelism's row-parallel sums (after `wo` and after `w_down`, two a layer).

Portable path: `jax.lax.psum` over the "model" axis (NCCL on GPUs), on every platform and mesh.

GPU path, opt-in with $JSPEC_TP_ALLREDUCE=p2p until a GPU run has timed it against NCCL: a one-shot
all-reduce over peer memory between the local CUDA GPUs of one process (`p2p_allreduce.cu`). Why:
an 8B decode step under model=2 runs 65 collectives of 8-128 KB, and NCCL took about 23 µs for each
(2×H200, `BENCHMARKS.md`), about 1.5 ms of a 3.7 ms step; a kernel on the compute stream that
reads its peers' buffers needs no NCCL launch and no second stream. Operands above 1 MiB and
dtypes other than bfloat16 / float32 keep psum. The sum runs in rank order on every device, so
every device holds bitwise the same result, as after psum.

The p2p path builds the CUDA source once per machine with nvcc (`cuda_build`), registers it as an
XLA FFI target, and sets up each device's buffers the first time a mesh is traced. It uses plain peer access, never NVLink
multicast.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ..sharding import TP_AXIS, tensor_parallel_mesh
from . import cuda_build

SOURCE = Path(__file__).with_name("p2p_allreduce.cu")
TARGET = "jspec_p2p_all_reduce"
CHOICES = ("nccl", "p2p")  # $JSPEC_TP_ALLREDUCE, read when a program is traced
MAX_BYTES = 1 << 20  # the CUDA source's slot size (kSlotBytes)
MAX_RANKS = 8
_DTYPES = (jnp.bfloat16, jnp.float32)
_PREPARED: set[tuple[tuple[int, ...], ...]] = set()
UNSET_HINT = "unset JSPEC_TP_ALLREDUCE (NCCL / psum)"


def choice() -> str:
    value = os.environ.get("JSPEC_TP_ALLREDUCE", "nccl")
    if value not in CHOICES:
        raise ValueError(f"JSPEC_TP_ALLREDUCE={value!r}: expected one of {', '.join(CHOICES)}")
    return value


def model_groups(mesh) -> tuple[tuple[int, ...], ...]:
    """The CUDA ordinals of each group of devices that sums together (one per index of the other
    mesh axes), each in the order of the "model" axis. Raises a one-line ValueError where the p2p
    path cannot run: devices that are not this process's CUDA GPUs, or more than MAX_RANKS a group."""
    devices = np.moveaxis(np.asarray(mesh.devices), list(mesh.axis_names).index(TP_AXIS), -1)
    groups = devices.reshape(-1, devices.shape[-1])
    bad = [d for d in groups.ravel() if d.platform != "gpu" or d.process_index != jax.process_index()]
    if bad:
        raise ValueError(f"JSPEC_TP_ALLREDUCE=p2p needs this process's CUDA GPUs, not {bad[0].platform} device "
                         f"{bad[0].id}: unset it (NCCL / psum)")
    if groups.shape[1] > MAX_RANKS:
        raise ValueError(f"JSPEC_TP_ALLREDUCE=p2p: model={groups.shape[1]}, at most {MAX_RANKS}")
    return tuple(tuple(int(d.local_hardware_id) for d in row) for row in groups)


def row_parallel_sum(y: jax.Array) -> jax.Array:
    """The sum over the "model" axis of each device's share `y` (inside tensor_parallel_map, which
    only generation uses: the p2p call has no gradient rule, and training never runs under model=N)."""
    mesh = tensor_parallel_mesh()
    if choice() == "p2p" and mesh is not None and y.dtype in _DTYPES and y.size * y.dtype.itemsize <= MAX_BYTES:
        groups = model_groups(mesh)
        if len(groups[0]) > 1:
            _prepare(groups)
            return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(y.shape, y.dtype))(y)
    return jax.lax.psum(y, TP_AXIS)


UNSET_HINT = "unset JSPEC_TP_ALLREDUCE (NCCL / psum)"


def build_command(out: Path, arch: str = "native") -> list[str]:
    """nvcc's command line for the all-reduce's shared library."""
    return cuda_build.build_command(SOURCE, out, arch=arch, unset_hint=UNSET_HINT)


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    """Build (once per machine), load and register the CUDA all-reduce."""
    lib = cuda_build.load(SOURCE, unset_hint=UNSET_HINT)
    lib.jspec_p2p_init.argtypes = (ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int)
    lib.jspec_p2p_init.restype = ctypes.c_int
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JspecP2pAllReduce), platform="CUDA")
    return lib


def _prepare(groups: tuple[tuple[int, ...], ...]) -> None:
    """Allocate the exchange buffers and enable peer access for these groups. Once per process: the
    buffers and call counters serve one grouping of the GPUs, so another mesh is refused."""
    if groups in _PREPARED:
        return
    if _PREPARED:
        raise ValueError(f"JSPEC_TP_ALLREDUCE=p2p serves one grouping of the GPUs a process ({next(iter(_PREPARED))}), "
                         f"not also {groups}: use one mesh, or unset it (NCCL / psum)")
    if len(groups[0]) not in (2, 4, 8):
        raise ValueError(f"JSPEC_TP_ALLREDUCE=p2p: model={len(groups[0])}; it runs model=2, 4 or 8")
    flat = [d for g in groups for d in g]
    status = _library().jspec_p2p_init((ctypes.c_int * len(flat))(*flat), len(groups), len(groups[0]))
    if status != 0:
        raise RuntimeError(f"JSPEC_TP_ALLREDUCE=p2p: peer-memory setup failed on GPUs {groups} (status {status}): "
                           "unset it (NCCL / psum)")
    _PREPARED.add(groups)
