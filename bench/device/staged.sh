#!/bin/bash
# Run a command on the lent GPU machine with what bench/device/stage.py staged installed.
#
#   bash bench/device/staged.sh python3 bench/generation.py --layers 28 ...
#
# Each device call carries one part (run's carry: [".stage/N"]); this collects the parts carried
# so far into /tmp/stage (kept while the machine stays warm: call again within 30 s). Until all
# have arrived it says how many it holds and exits 3 without running anything; then it checks
# the archive's sha256, installs its wheels into /tmp/site once, and runs the command with them
# on PYTHONPATH, beside bench/device/shim (jax 0.11's missing jax.core.is_constant_dim) and,
# when Ray was not staged (stage.py --for bench), bench/device/stub's stand-in for it; with
# SMOLLM2_GGUF naming the staged GGUF file (bench/smollm2.py converts it on first use).
set -euo pipefail
cd "$(dirname "$0")/../.."
here=$PWD
mkdir -p /tmp/stage
if [ ! -e /tmp/stage/installed ]; then
  for manifest in .stage/*/manifest.json; do
    [ -e "$manifest" ] || continue
    index=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["index"])' "$manifest")
    cp "$(dirname "$manifest")/part" "/tmp/stage/part.$index"
    cp "$manifest" /tmp/stage/manifest.json
  done
  if [ ! -e /tmp/stage/manifest.json ]; then
    echo "no staged parts: run bench/device/stage.py here and carry .stage/1" >&2
    exit 3
  fi
  read -r parts sha < <(python3 -c 'import json; m = json.load(open("/tmp/stage/manifest.json")); print(m["parts"], m["sha256"])')
  have=$(find /tmp/stage -maxdepth 1 -name 'part.*' | wc -l)
  if [ "$have" -lt "$parts" ]; then
    echo "staged $have of $parts parts; carry the next (.stage/$((have + 1))) within 30 s"
    exit 3
  fi
  for i in $(seq 1 "$parts"); do cat "/tmp/stage/part.$i"; done > /tmp/stage/content.tar
  echo "$sha  /tmp/stage/content.tar" | sha256sum -c --quiet
  tar -xf /tmp/stage/content.tar -C /tmp/stage
  rm -f /tmp/stage/content.tar /tmp/stage/part.*
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site /tmp/stage/content/wheels/*.whl
  touch /tmp/stage/installed
  echo "installed the staged wheels into /tmp/site"
fi
path=/tmp/site:$here/bench/device/shim
[ -d /tmp/site/ray ] || path=$path:$here/bench/device/stub
export PYTHONPATH=$path${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
gguf=$(find /tmp/stage/content -maxdepth 1 -name '*.gguf' | head -1)
[ -z "$gguf" ] || export SMOLLM2_GGUF=$gguf  # bench/smollm2.py converts it on first use
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
fi
exec "$@"
