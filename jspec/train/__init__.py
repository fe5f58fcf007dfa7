"""Draft-head training (EAGLE-1 / EAGLE-3) with Optax, Orbax and a (data, fsdp) device mesh.

    config   TrainConfig / DataConfig / RunConfig, recipe JSON files (training/*.json)
    data     self-distillation dataset: shard format, per-host deterministic loader, distillation
    losses   online target features, TTT unroll, EAGLE-1 / EAGLE-3 losses
    step     optimizer, sharding, the jitted train step
    trainer  the loop: metrics (tqdm + JSONL), Orbax checkpoints, exact resume
    cli      `jspec train-head` (add_train_args / run_train)
    testing  tiny configs and compile-free parameters for CPU tests
"""
