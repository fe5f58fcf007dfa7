"""The suite's own XLA flags (conftest.py): what they add, and that a jaxlib without the CPU
fusion-emitter flag never sees it (XLA aborts the process on an unknown flag); the end of a
session stays cheap."""

import gc
import importlib.metadata

import conftest


def test_test_flags_append_what_is_missing_and_refuse_another_device_count():
    flags, error = conftest.with_test_xla_flags("--xla_backend_optimization_level=1")
    assert error is None
    assert "--xla_backend_optimization_level=1" in flags.split()  # the environment's own setting wins
    assert "--xla_backend_optimization_level=0" not in flags.split()
    assert f"{conftest.DEVICE_COUNT_FLAG}=8" in flags.split()
    _, error = conftest.with_test_xla_flags(f"{conftest.DEVICE_COUNT_FLAG}=4")
    assert error and "remove it from XLA_FLAGS" in error


def test_cpu_fusion_emitter_flag_only_for_jaxlib_before_0_11(monkeypatch):
    for version, known in (("0.10.2", True), ("0.11.2", False), ("0.12.0.1", False), ("1.0.0", False)):
        monkeypatch.setattr(importlib.metadata, "version", lambda name, v=version: v)
        assert conftest.knows_cpu_fusion_emitters_flag() is known, version


def test_a_finished_session_leaves_the_garbage_collector_nothing_to_walk():
    """After the last test, pytest's gc passes skip what the tests left (conftest.pytest_sessionfinish):
    walking it outlasted xdist's 5 s and printed a KeyboardInterrupt from jax's gc callback."""
    assert gc.get_freeze_count() == 0
    try:
        conftest.pytest_sessionfinish(session=None)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
