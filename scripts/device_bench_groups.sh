#!/usr/bin/env bash
# Benchmark groups, one process per GPU, all on the 80 MT-Bench first turns, bf16, 256 new tokens.
# Every group times jspec AR in its own process, so each ratio is measured side by side on one card.
#   GPU 0  batch 1     the new EAGLE-3 head (NEW_HEAD): chain K=6, EAGLE-2 tree, auto chain and tree
#   GPU 1  batch 1     the head shipped before (preset default): chain K=6 and tree; n-gram heuristic and auto
#   GPU 2  batch 16    auto policies (new head chain and tree, n-gram)
#   GPU 3  batch 8,32  the same auto methods
# Rows: $OUT/bench.tgz (models/<preset>/bench/*.json, logs). Groups run under GROUP_S seconds each.
set -uo pipefail
export PYTHONPATH="$PWD:/root/stage/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PRESET=smollm2-135m-instruct
NEW=${NEW_HEAD:-/root/jspec-run/eagle3/eagle}
GROUP_S=${GROUP_S:-330}
LOGS=/root/bench_logs
mkdir -p "$LOGS" "$OUT"
ngpu=$(nvidia-smi -L | wc -l)

group() {  # gpu out batches methods [extra args]
  local gpu=$1 out=$2 batches=$3 methods=$4; shift 4
  CUDA_VISIBLE_DEVICES=$gpu timeout "$GROUP_S" python3 -m jspec.cli bench --model $PRESET --tasks mt_bench \
    --max-new-tokens 256 --batch "$batches" --dtype bfloat16 --methods "$methods" --out "$out" --no-plots \
    --benchmarks-md "$LOGS/$out.md" "$@" > "$LOGS/$out.log" 2>&1
  echo "$out: exit $?"
}

AUTO="ar,spec:eagle3:$NEW:auto,spec:eagle3:$NEW:auto:tree,spec:ngram:auto"
group 0 new_head_b1 1 "ar,spec:eagle3:$NEW:static:k=6,spec:eagle3:$NEW:static:tree,spec:eagle3:$NEW:auto,spec:eagle3:$NEW:auto:tree" \
  --round-cost 1 &
group $((1 % ngpu)) shipped_head_b1 1 "ar,spec:eagle3:static:k=6,spec:eagle3:static:tree,spec:ngram:heuristic,spec:ngram:auto" &
group $((2 % ngpu)) auto_b16 16 "$AUTO" --round-cost 16 &
group $((3 % ngpu)) auto_b8_b32 8,32 "$AUTO" &
wait
for f in "$LOGS"/*.log; do echo "== $f"; grep -v "batch/s\]$\|it/s\]$" "$f" | tail -n 8; done
tar czf "$OUT/bench.tgz" models/$PRESET/bench/*.json models/$PRESET/round_cost_*.json "$LOGS"
ls -la "$OUT"
