"""Benchmark harness: every decoding method reports Spec-Bench metrics through it.

``protocol`` says what a method is, ``harness`` times it, ``metrics`` turns timings into numbers,
``methods`` adapts jspec and transformers, ``report`` / ``plots`` write results, ``cli`` is
`jspec bench`.
"""

from jspec.bench.harness import RunContext, batches_of, benchmark_group, run_method
from jspec.bench.protocol import Method, MethodSpec, RowResult, parse_method_spec, parse_method_specs

__all__ = [
    "Method", "MethodSpec", "RowResult", "RunContext", "batches_of", "benchmark_group", "parse_method_spec",
    "parse_method_specs", "run_method",
]
