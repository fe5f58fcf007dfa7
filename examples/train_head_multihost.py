"""Train an EAGLE draft head on a multi-host mesh (every device of every host), with jspec.train.

The recipe: start ONE process per host, each running this same command; the first thing each
process does is `jax.distributed.initialize` (via `jspec.train.step.maybe_initialize_distributed`),
after which `jax.devices()` lists every device of every host and one Mesh spans them all.

    # host 0 (the coordinator) and host 1, same command, different JAX_PROCESS_ID:
    JAX_COORDINATOR_ADDRESS=10.0.0.1:8476 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 \\
        python examples/train_head_multihost.py --model smollm2-135m-instruct --data /shared/distill --out /shared/head
    JAX_COORDINATOR_ADDRESS=10.0.0.1:8476 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1 \\
        python examples/train_head_multihost.py --model smollm2-135m-instruct --data /shared/distill --out /shared/head

    # SLURM / Open MPI / Cloud TPU pods: JAX finds the cluster itself
    JSPEC_DISTRIBUTED=1 srun python examples/train_head_multihost.py ...

    # one host (what CI runs): no environment needed
    python examples/train_head_multihost.py --tiny --out /tmp/head

What makes it multi-host:
  - the mesh is (data, fsdp) over ALL global devices (`step.make_mesh`): the batch is split over
    both axes, the head's matrices over fsdp; XLA inserts the cross-host collectives;
  - each process reads only its own rows of every global batch (`ShardedLoader(process_index,
    process_count)`), and `step.global_batch` assembles them into one global array
    (`jax.make_array_from_process_local_data`), so no host ever holds the whole batch;
  - every process runs the same jitted step; only process 0 writes metrics and prints;
    checkpoints (Orbax) are written cooperatively, so --out must be on a filesystem all hosts see,
    as must --data (make it once with `jspec distill` or `jspec train-head --distill-only`).
"""

from __future__ import annotations

import argparse
import os

import jax
import numpy as np

from jspec.heads import eagle as H
from jspec.train import step as S
from jspec.train.config import RunConfig, TrainConfig
from jspec.train.data import write_dataset
from jspec.train.trainer import train


def tiny_setup(data_dir: str, seq_len: int):
    """A tiny random target and a patterned synthetic dataset (x <- 3x + c mod V), for CI."""
    from jspec.model import init_params
    from jspec.train.testing import numpy_params, tiny_target_config

    cfg = tiny_target_config()
    params = numpy_params(init_params, cfg, seed=0, scale=0.3)
    if jax.process_index() == 0 and not os.path.exists(os.path.join(data_dir, "meta.json")):
        rng = np.random.default_rng(0)
        rows = []
        for _ in range(32):
            x, c = int(rng.integers(2, 100)), int(rng.integers(1, 7))
            resp = []
            for _ in range(seq_len - 6):
                x = (3 * x + c) % (cfg.vocab_size - 2) + 2
                resp.append(x)
            rows.append((rng.integers(2, cfg.vocab_size, 4).tolist(), resp + [1]))
        write_dataset(data_dir, rows, seq_len=seq_len, pad_id=0, vocab_size=cfg.vocab_size, rows_per_shard=8)
    return cfg, params


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random target + synthetic data (CI)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="target preset or checkpoint")
    ap.add_argument("--data", default=None, help="distilled dataset dir (default for --tiny: OUT/data)")
    ap.add_argument("--out", required=True, help="checkpoints and metrics.jsonl (shared by all hosts)")
    ap.add_argument("--kind", default="eagle3", choices=["eagle3", "eagle1"])
    ap.add_argument("--draft-vocab", type=int, default=0, help="EAGLE-3 draft vocabulary (0: the target's)")
    ap.add_argument("--fsdp", type=int, default=1, help="devices per fsdp group; the rest form the data axis")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32, help="global batch over all hosts")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=6e-4)
    a = ap.parse_args(argv)

    S.maybe_initialize_distributed()  # must come before anything touches a device
    first = jax.process_index() == 0
    if a.tiny:
        a.data = a.data or os.path.join(a.out, "data")
        cfg, params = tiny_setup(a.data, a.seq_len)
    else:
        from jspec.presets import resolve_model

        cfg, params, _ = resolve_model(a.model, tokenizer=False)
    mesh = S.make_mesh(a.fsdp)  # every device of every process
    if first:
        print(f"{jax.process_count()} process(es), {jax.device_count()} devices "
              f"({jax.local_device_count()} local), mesh {dict(mesh.shape)}")
    hcfg = H.default_head_config(a.kind, cfg, draft_vocab_size=a.draft_vocab)
    tc = TrainConfig(kind=a.kind, ttt_steps=3 if a.kind == "eagle3" else 1, batch_size=a.batch, seq_len=a.seq_len,
                     steps=a.steps, lr=a.lr, warmup_steps=max(1, a.steps // 20),
                     compute_dtype="float32" if jax.default_backend() == "cpu" else "bfloat16",
                     logits_chunk=min(256, a.seq_len // 2))
    run = RunConfig(ckpt_every=max(1, a.steps // 4), log_every=max(1, a.steps // 8), fsdp=a.fsdp)
    res = train(hcfg, tc, params, a.data, a.out, run=run, mesh=mesh, progress=first, log_fn=print if first else (lambda *_: None))
    if first:
        print(f"trained {res.last_step} steps: loss {res.losses[1]:.3f} -> {res.losses[res.last_step]:.3f}")
    return res


if __name__ == "__main__":
    main()
