import os

# Eight fake CPU devices for the sharding tests; must be set before jax is imported. The tests are
# XLA-compile-bound (tiny models, hundreds of programs): LLVM's backend optimization level 0 cuts
# CPU compile time by about a third and the tiny programs run as fast. XLA:CPU's older elemental
# fusion emitters (instead of the MLIR fusion emitters) halve compile time again; same HLO, same
# sampled tokens in the chi-square tests. Codegen settings only: nothing of jspec changes.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                      "--xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# Under `pytest -n 2 --dist loadfile` a file runs whole on one worker, handed out in collection
# order: the longest files go first (longest-processing-time-first), so that no long file starts
# near the end while the other worker idles. Ordered by measured per-file seconds on a 2-core CPU;
# a file not listed keeps its place after these. Only the order changes, never the tests.
_LONGEST_FIRST = [
    "test_smollm2_gguf.py", "test_lossless_sampling.py", "test_spec.py", "test_rules.py", "test_cli.py",
    "test_specbranch.py", "test_ppsd.py", "test_shipped_head.py", "test_shipped_gemma_head.py",
    "test_spec_heads.py", "test_train.py", "test_greedy_reference.py", "test_head_kernels.py",
    "test_parallel.py", "test_auto.py", "test_pearl.py", "test_examples.py", "test_kernels.py",
    "test_spec_sampling.py", "test_tree.py", "test_dlm.py", "test_packing.py", "test_policies.py", "test_head_pipeline.py",
    "test_draft_model.py", "test_checkpoint.py",
]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay contiguous
