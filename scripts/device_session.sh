#!/usr/bin/env bash
# The GPU session behind the committed head and benchmark rows, as a chain of back-to-back device
# calls (each ≤ 10 minutes; the machine's disk keeps /root/* between them). On a 4-GPU host:
#
#   call 1 (carry .stage/p0; shipped head moved out of the tree):  bash scripts/device_session.sh costs
#   call 2 (carry .stage/p1 .stage/corpus):                          bash scripts/device_session.sh train
#   call 3 (shipped head back in the tree):                          bash scripts/device_session.sh bench
#
# `costs` stages the first GGUF half and measures the auto policy's cost table with random weights
# (one batch size per GPU). `train` stages the second half, distils for DISTILL_S seconds and trains
# the EAGLE-3 head for TRAIN_S seconds, both on every GPU. `bench` runs the benchmark groups of
# scripts/device_bench_groups.sh, one process per GPU.
# Results land in $OUT (the device tool brings back ≤ 8 files of ≤ 16 MB).
set -uo pipefail
export PYTHONPATH="$PWD:/root/stage/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
RUN=/root/jspec-run
W=/root/work
PRESET=smollm2-135m-instruct
mkdir -p "$RUN" "$W" "$OUT"
card() { python3 -c "import jax; print(jax.devices()[0].device_kind.replace(' ', '_'))"; }

case ${1:?usage: device_session.sh costs|train|bench} in
  costs)
    bash scripts/device_stage.sh .stage/p0 2
    nvidia-smi -L
    mkdir -p /root/costs
    i=0
    for b in 1 8 16 32; do
      CUDA_VISIBLE_DEVICES=$i timeout 240 python3 scripts/measure_card_costs.py --batch $b --out /root/costs/b$b.json \
        > /root/costs/b$b.log 2>&1 &
      i=$((i + 1))
    done
    wait
    tail -n 2 /root/costs/*.log
    python3 scripts/measure_card_costs.py --merge /root/costs/b*.json --out "/root/costs/round_cost_$(card).json"
    cp /root/costs/round_cost_*.json "$OUT/"
    ;;
  train)
    bash scripts/device_stage.sh .stage/p1 2
    bash scripts/device_train_heads.sh stage
    timeout $((DISTILL_S + 120)) bash scripts/device_train_heads.sh distill "$DISTILL_S"
    timeout $((TRAIN_S + 120)) bash scripts/device_train_heads.sh train eagle3 "$TRAIN_S" > $W/eagle3.log 2>&1
    grep -v "it/s\]$" $W/eagle3.log | tail -n 25
    ls -la "$OUT"
    ;;
  bench)
    cp /root/costs/round_cost_*.json models/$PRESET/ 2>/dev/null
    bash scripts/device_bench_groups.sh
    ;;
esac
