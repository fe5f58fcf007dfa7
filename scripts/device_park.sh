#!/usr/bin/env bash
# The device tool sends the working tree (tracked files included) with every call, 64 MiB at most,
# and the shipped weights alone are larger. Park them before a device session and bring them back
# after it; a pipeline that needs a shipped file carries it as a staged part instead.
#
#   bash scripts/device_park.sh park     # tracked *.safetensors -> .parked/ (ignored), same paths
#   bash scripts/device_park.sh unpark   # and back
#   bash scripts/device_park.sh size     # what a device call would carry now
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
case ${1:?usage: device_park.sh park|unpark|size} in
  park)
    git ls-files -z '*.safetensors' | while IFS= read -r -d '' f; do
      [ -f "$f" ] || continue
      mkdir -p ".parked/$(dirname "$f")" && mv "$f" ".parked/$f"
    done ;;
  unpark)
    [ -d .parked ] || exit 0
    (cd .parked && find . -type f -print0) | while IFS= read -r -d '' f; do
      mkdir -p "$(dirname "$f")" && mv ".parked/$f" "$f"
    done
    rm -rf .parked ;;
  size)
    { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 du -cb 2>/dev/null | tail -n 1 ;;
  *) echo "unknown command '$1': park | unpark | size" >&2; exit 2 ;;
esac
