#!/usr/bin/env bash
# Rebuild what scripts/device_train_heads.sh left in $OUT: KIND.tar.partN pieces -> DEST/KIND/.
#   bash scripts/unpack_device_out.sh FILES_AT DEST      (FILES_AT: the folder a device call's files came back in)
# e.g. DEST=runs/device: runs/device/eagle3/eagle/{config.json,model.safetensors,ldlp.*}, metrics.jsonl, ...
set -euo pipefail
src=${1:?usage: unpack_device_out.sh FILES_AT DEST}
dest=${2:?usage: unpack_device_out.sh FILES_AT DEST}
found=0
for first in $(find "$src" -name '*.tar.part0' | sort); do
  kind=$(basename "$first" .tar.part0)
  mkdir -p "$dest/$kind"
  cat "$(dirname "$first")/$kind".tar.part* | tar -C "$dest/$kind" -xf -
  cp "$(dirname "$first")/${kind}_summary.json" "$dest/$kind/" 2>/dev/null || true
  echo "unpacked $kind into $dest/$kind"; found=1
done
find "$src" -name 'distill_summary.json' -exec cp {} "$dest/" \; 2>/dev/null || true
[ "$found" = 1 ] || echo "no *.tar.part0 under $src"
