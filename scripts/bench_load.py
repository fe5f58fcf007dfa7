"""Loading a sharded Hugging Face checkpoint of real size: load time and peak host memory.

    python scripts/bench_load.py --shape llama-3.1-8b --dir CKPT_DIR [--mesh model=2] [--out DIR]

Writes a random target with the shape's Llama config and tensor names, sharded as Hugging Face
shards it (bfloat16, 5 GB shards, an index; skipped when CKPT_DIR already holds that checkpoint),
then loads it in a fresh process, so the writer's memory is not counted, with
`jspec.checkpoint.hf.load_hf` onto the first device (or over `--mesh`), checks a few tensors
against the files, and appends one row to <out>/load_<card>.json:

  shape, card, method ("load"), devices, mesh, dtype, shards, weight_bytes, seconds,
  peak_host_bytes (VmHWM of the loading process: the high-water mark of its resident memory,
  JAX and the runtime included), baseline_host_bytes (resident memory once JAX has started, before
  loading), peak_over_weights.

The loader reads the files through the page cache the writer just filled (a warm load); a cold
load adds the disk's read time. On a CPU host the "device" memory is host memory too, so there the
peak includes the loaded parameters themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from jspec.cards import card_name
from jspec.checkpoint.files import SAFETENSORS_INDEX
from jspec.checkpoint.hf import CONFIG_FILE, hf_config_dict
from jspec.checkpoint.synthetic import llama31_8b_target, write_sharded_target

_LLAMA31_8B = llama31_8b_target()
SHAPES = {
    "llama-3.1-8b": _LLAMA31_8B,
    "llama-3.2-1b": _LLAMA31_8B.replace(hidden_size=2048, intermediate_size=8192, num_layers=16, head_dim=64,
                                        tie_word_embeddings=True, rope_scaling=("llama3", 32.0, 1.0, 4.0, 8192)),
    # a two-layer model for checking this script in seconds
    "tiny": _LLAMA31_8B.replace(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=32, bos_token_id=1, eos_token_ids=(2,)),
}


def proc_status_bytes(field: str) -> int:
    """A memory line of /proc/self/status (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def write_checkpoint(cfg, path: Path, dtype: str, shard_bytes: int) -> None:
    want = hf_config_dict(cfg, dtype)
    config, index = path / CONFIG_FILE, path / SAFETENSORS_INDEX
    if config.is_file() and index.is_file() and json.loads(config.read_text()) == want:
        print(f"{path}: checkpoint of this shape already there", flush=True)
        return
    t0 = time.perf_counter()
    files = write_sharded_target(str(path), cfg, dtype=dtype, max_shard_bytes=shard_bytes, reuse=True)
    print(f"wrote {len(files) - 2} shards to {path} in {time.perf_counter() - t0:.1f} s", flush=True)


def load_and_measure(path: Path, shape: str, dtype: str, mesh_spec: str | None) -> dict:
    """Run in the child process: load, then report (the import of jax comes first, as in any user's)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from safetensors import safe_open

    from jspec.checkpoint.hf import load_hf
    from jspec.sharding import mesh_label, parse_mesh

    mesh = parse_mesh(mesh_spec)
    jax.block_until_ready(jnp.zeros(()) + 1)  # the runtime started: what any program pays before loading
    baseline = proc_status_bytes("VmRSS")
    t0 = time.perf_counter()
    cfg, params = load_hf(path, jnp.dtype(dtype), mesh=mesh)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    peak = proc_status_bytes("VmHWM")
    weight_bytes = int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params)))
    index = json.loads((path / SAFETENSORS_INDEX).read_text())["weight_map"]
    last = cfg.num_layers - 1
    checks = {"wqkv": ("self_attn.q_proj.weight", np.s_[last, :, : cfg.q_size]),
              "w_down": ("mlp.down_proj.weight", np.s_[last])}
    for leaf, (hf_name, where) in checks.items():
        name = f"model.layers.{last}.{hf_name}"
        with safe_open(str(path / index[name]), framework="numpy") as f:
            want = f.get_tensor(name).T
        got = np.asarray(params["layers"][leaf][where])
        if not np.array_equal(got.astype(np.float32), want.astype(np.float32)):
            raise AssertionError(f"loaded {leaf} differs from {name} in the files")
    return dict(shape=shape, card=card_name(), method="load",
                devices=1 if mesh is None else mesh.size, mesh=mesh_label(mesh) or None, dtype=dtype,
                shards=len(set(index.values())), weight_bytes=weight_bytes, seconds=round(seconds, 2),
                peak_host_bytes=peak, baseline_host_bytes=baseline, peak_over_weights=round(peak / weight_bytes, 3))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--dir", required=True, help="where the checkpoint is written (local disk)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--mesh", default=None, help="load over this mesh, e.g. model=2 (default: one device)")
    ap.add_argument("--shard-bytes", type=int, default=5 * 10**9, help="largest shard (Hugging Face's default)")
    ap.add_argument("--out", default=os.environ.get("OUT", "shape-results"))
    ap.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args(argv)
    path = Path(args.dir)
    if args.load_only:
        print("ROW " + json.dumps(load_and_measure(path, args.shape, args.dtype, args.mesh)), flush=True)
        return
    write_checkpoint(SHAPES[args.shape], path, args.dtype, args.shard_bytes)
    child = [sys.executable, __file__, "--load-only", "--shape", args.shape, "--dir", str(path), "--dtype", args.dtype]
    if args.mesh:
        child += ["--mesh", args.mesh]
    done = subprocess.run(child, capture_output=True, text=True)
    sys.stderr.write(done.stderr[-4000:])
    rows = [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if done.returncode or not rows:
        raise SystemExit(f"the loading process failed (exit {done.returncode})")
    row = rows[0]
    print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    file = out / f"load_{row['card'].replace(' ', '_')}.json"
    table = json.loads(file.read_text()) if file.is_file() else []
    file.write_text(json.dumps(table + [row], indent=1) + "\n")


if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "bench_load.py"))
