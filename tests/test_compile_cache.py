"""The persistent compilation cache (jspec.compile_cache): where it lives, that a second process
loads every program the first compiled, and that program keys do not change between processes."""

import os
import subprocess
import sys
from pathlib import Path

from jspec import compile_cache as C

TESTS = Path(__file__).resolve().parent
# the checkout under test first (not an installed jspec), and the tests' tiny models
PATHS = os.pathsep.join([str(TESTS.parent), str(TESTS)])


def test_the_cache_directory_is_the_flag_then_the_environment_then_the_default(monkeypatch, tmp_path):
    for name in (C.ENV, "JAX_COMPILATION_CACHE_DIR", "JSPEC_CACHE_DIR", "JSPEC_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert C.compile_cache_dir() == str(tmp_path / ".cache" / "jspec" / "xla")
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "user"))
    assert C.compile_cache_dir() == str(tmp_path / "user" / "xla")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))  # a user's own JAX setting
    assert C.compile_cache_dir() == str(tmp_path / "jax")
    monkeypatch.setenv(C.ENV, "~/here")
    assert C.compile_cache_dir() == str(tmp_path / "here")
    assert C.compile_cache_dir(str(tmp_path / "flag")) == str(tmp_path / "flag")
    for off in ("off", "0", "none", "OFF"):
        assert C.compile_cache_dir(off) is None
        monkeypatch.setenv(C.ENV, off)
        assert C.compile_cache_dir() is None
    assert C.compile_cache_dir(str(tmp_path / "flag")) == str(tmp_path / "flag")  # the flag wins over the variable


def _run(code: str, cache: Path) -> str:
    env = {**os.environ, C.ENV: str(cache), "JAX_PLATFORMS": "cpu", "PYTHONPATH": PATHS}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


COUNT_EVENTS = """
import jax
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
"""

AR_GENERATE = COUNT_EVENTS + """
import spec_tiny
from jspec.generate import generate
generate(spec_tiny.make_target(), spec_tiny.CFG, [[5, 6, 7, 8], [9, 10]], max_new_tokens=8)
print(events.count("/jax/compilation_cache/cache_hits"), events.count("/jax/compilation_cache/cache_misses"))
"""


def test_a_second_process_compiles_nothing(tmp_path):
    """generate() turns the cache on by itself; a second process loads each program the first wrote."""
    cache = tmp_path / "xla"
    hits, misses = map(int, _run(AR_GENERATE, cache).split())
    written = sorted(os.listdir(cache))
    assert misses >= 1 and hits == 0 and len(written) >= misses
    hits, misses = map(int, _run(AR_GENERATE, cache).split())
    assert misses == 0 and hits == len(written)
    assert sorted(os.listdir(cache)) == written


PROGRAM_HASHES = """
import hashlib
import jax
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir, passmanager
from jspec import model as M
import test_export as T

def key_text(text):  # what the cache key hashes: the module without its debug locations
    with mlir.make_ir_context():
        module = ir.Module.parse(text)
        passmanager.PassManager.parse("builtin.module(strip-debuginfo)").run(module.operation)
        return str(module)

for name in ("ar", "chain", "tree", "pearl"):  # this host's programs
    print(name, hashlib.sha256(key_text(T.program(name).trace().lower().as_text()).encode()).hexdigest())
jax.default_backend = lambda: "gpu"  # as traced on one GPU: the Triton kernels' serialized IR included
with M.per_device_program():
    for name in ("ar", "tree"):
        text = T.program(name, T.GPU_CFG).export(("cuda",), disabled_checks=T.TRITON_OK).mlir_module()
        print("gpu_" + name, hashlib.sha256(key_text(text).encode()).hexdigest())
"""


def test_program_keys_do_not_change_between_processes():
    """No object ids, random constants or unordered sets in any program: two processes lower the
    same text for each (the persistent cache's key is a hash of it)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": PATHS}
    procs = [subprocess.Popen([sys.executable, "-c", PROGRAM_HASHES], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    first, second = (dict(line.split() for line in out.splitlines()) for out, _ in outs)
    assert len(first) == 6 and first == second
