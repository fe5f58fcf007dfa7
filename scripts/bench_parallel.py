#!/usr/bin/env python
"""Multi-device throughput: one device vs data- and tensor-parallel meshes (jspec.bench.parallel).

    python scripts/bench_parallel.py --out-dir OUT [options of jspec.bench.parallel]
"""

from jspec.bench.parallel import main

if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "bench_parallel.py"))
