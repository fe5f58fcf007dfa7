import gc
import os

import pytest

# Eight fake CPU devices for the sharding tests; must be set before jax is imported. The tests are
# XLA-compile-bound (tiny models, hundreds of programs): LLVM's backend optimization level 0 cuts
# CPU compile time by about a third and the tiny programs run as fast. XLA:CPU's older elemental
# fusion emitters (instead of the MLIR fusion emitters) halve compile time again where jaxlib still
# has them (before 0.11); same HLO, same sampled tokens in the chi-square tests. Codegen settings
# only: nothing of jspec changes.
# They are appended to an XLA_FLAGS already in the environment (whose own settings win), except
# that a different device count is an error: the 8-device tests would otherwise not run.
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def knows_cpu_fusion_emitters_flag() -> bool:
    """Whether the installed jaxlib's XLA has --xla_cpu_use_fusion_emitters: it was dropped in
    jaxlib 0.11, where the MLIR emitters are the only ones, and XLA aborts the process on an
    unknown flag. Read from the package metadata: jax must not be imported before the flags are set."""
    import importlib.metadata
    import re

    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return False
    return tuple(int(v) for v in re.findall(r"\d+", version)[:2]) < (0, 11)


CPU_FUSION_EMITTERS_KNOWN = knows_cpu_fusion_emitters_flag()
TEST_XLA_FLAGS = (f"{DEVICE_COUNT_FLAG}=8", "--xla_backend_optimization_level=0") + (
    ("--xla_cpu_use_fusion_emitters=false",) if CPU_FUSION_EMITTERS_KNOWN else ())


def with_test_xla_flags(existing: str) -> tuple[str, str | None]:
    """(XLA_FLAGS with the test flags it lacks appended, an error line or None)."""
    flags = existing.split()
    set_names = {f.split("=", 1)[0] for f in flags}
    counts = [f for f in flags if f.split("=", 1)[0] == DEVICE_COUNT_FLAG]
    error = None
    if counts and counts[-1] != TEST_XLA_FLAGS[0]:
        error = (f"XLA_FLAGS sets {counts[-1]}; the sharding tests need {TEST_XLA_FLAGS[0]}: "
                 f"remove it from XLA_FLAGS (conftest adds it)")
    return " ".join(flags + [f for f in TEST_XLA_FLAGS if f.split("=", 1)[0] not in set_names]), error


os.environ["XLA_FLAGS"], _XLA_FLAGS_ERROR = with_test_xla_flags(os.environ.get("XLA_FLAGS", ""))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent compilation cache (jspec.compile_cache turns it on by default): the suite's programs
# would fill the user's cache, and tests that need one name their own directory.
os.environ["JSPEC_COMPILE_CACHE"] = "off"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import tqdm  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# No tqdm monitor thread: the first progress bar (transformers' weight loading, jspec's own bars)
# would start tqdm's TMonitor, which wakes every 10 s for the rest of the worker's life to refresh
# bars that tests never look at. Without it a worker runs no Python thread of its own beside the
# test's and execnet's, and a crash or faulthandler_timeout dump (pyproject.toml) lists only those.
# Bars still draw; only the background refresh of a stalled bar is off. Set on the base class, so
# tqdm.auto's and transformers' subclasses inherit it.
tqdm.tqdm.monitor_interval = 0


# Under `pytest -n 2 --dist loadfile` a file runs whole on one worker, handed out in collection
# order: the longest files go first (longest-processing-time-first), so that no long file starts
# near the end while the other worker idles. Ordered by measured per-file seconds on a 2-core CPU;
# a file not listed keeps its place after these. Only the order changes, never the tests.
_LONGEST_FIRST = [
    "test_smollm2_gguf.py", "test_lossless_sampling.py", "test_spec.py", "test_rules.py", "test_cli.py",
    "test_specbranch.py", "test_ppsd.py", "test_shipped_head.py", "test_shipped_gemma_head.py",
    "test_spec_heads.py", "test_train.py", "test_greedy_reference.py", "test_head_kernels.py",
    "test_parallel.py", "test_calibration.py", "test_export.py", "test_compile_cache.py", "test_hybrid.py", "test_auto.py", "test_pearl.py", "test_tensor_parallel.py", "test_examples.py", "test_kernels.py",
    "test_spec_sampling.py", "test_tree.py", "test_dlm.py", "test_packing.py", "test_policies.py", "test_head_pipeline.py",
    "test_draft_model.py", "test_checkpoint.py", "test_engine_contracts.py",
]


def pytest_configure(config):
    if _XLA_FLAGS_ERROR:
        raise pytest.UsageError(_XLA_FLAGS_ERROR)
    if jax.default_backend() == "cpu" and jax.device_count() != 8:  # e.g. jax imported before this file
        raise pytest.UsageError(f"the tests need 8 CPU devices, jax has {jax.device_count()}: "
                                f"set XLA_FLAGS={TEST_XLA_FLAGS[0]} before jax is imported")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """Keep the end of a session cheap: every object the tests left behind is frozen out of the
    garbage collector. After a session pytest's unraisable-exception plugin runs two full gc
    passes, each calling jax's _xla_gc_callback; over what half the suite leaves in an xdist
    worker (compiled programs, traces) they outlast the 5 s execnet gives a worker to finish
    after its session, its SIGINT then lands in that callback, and a KeyboardInterrupt traceback
    printed at 100%. The process is about to exit; the OS frees its memory."""
    del session
    gc.freeze()


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay contiguous


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs():
    """After each test file, drop what jax compiled for it (jax.clear_caches; the file's own
    module fixtures are torn down before this one, set up first of its scope).

    Every program XLA:CPU compiles keeps its JIT code in memory mappings of its own, about three
    per compiled kernel (code, read-only data, data; ~95 for a small jitted function), for as long
    as jax's caches hold the executable. A `--dist loadfile` worker that keeps everything it ran
    peaked at 52,000 mappings (and 9 GB resident) in a local `make test`, against the kernel's
    vm.max_map_count of 65,530. At that limit mmap fails, XLA logs "LLVM compilation error: Cannot
    allocate memory" and the process dies of a segmentation fault in backend_compile_and_load
    (reproduced by filling a process's mappings up to the limit, then jitting). That is the
    likely cause of the worker segfault CI saw at 97% of the suite (intermittent: the count
    depends on which files a worker drew). Cleared per file, a worker stays under 12,500
    mappings (the largest file's) and about 3 GB; files share few programs (each builds its own
    tiny models), and the suite takes as long as before (507 s against 505 s, 2-core CPU)."""
    yield
    jax.clear_caches()


@pytest.fixture(autouse=True)
def _user_cache(tmp_path, monkeypatch):
    """Each test gets its own $JSPEC_CACHE (cost tables measured on the fly land there), so no test
    reads what another, or a user's run, cached."""
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
