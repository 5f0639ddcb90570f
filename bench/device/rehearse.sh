#!/bin/bash
# Rehearse the GPU procedure (bench/device/README.md) on this CPU machine, so that a lent
# machine's 15 minutes are not spent finding a missing wheel:
#
#   bash bench/device/rehearse.sh                        # the default job, 50 steps
#   bash bench/device/rehearse.sh python3 bench/real_model.py --steps 2
#
# It stands in for the image with a CPython 3.12 virtualenv holding what stage.py assumes the
# image provides (at this venv's versions: jax 0.10.2 on the CPU, not the image's 0.11.2 with
# CUDA, no torch), copies the working tree (tracked and untracked files, as the device tool
# does), carries the staged parts into it one call at a time through bench/device/staged.sh
# (each must exit 3 but the last), then runs the command there through staged.sh, with a fresh
# cache (SmolLM2's conversion needs torch for its tokenizer: without it, this machine's
# converted checkpoint is copied in). Run
# `python bench/device/stage.py --for run` first. A CPython 3.12: $PY312, else
# /tmp/py312/bin/python3.12, else it is built there from the Ubuntu archive's source tarball
# (about ten minutes on two cores). Uses /tmp/stage and /tmp/site as the device does: not while
# another rehearsal runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
work=/tmp/rehearse
py=${PY312:-/tmp/py312/bin/python3.12}
[ -d .stage/1 ] || { echo "nothing staged: run python bench/device/stage.py --for run" >&2; exit 2; }

if [ ! -x "$py" ]; then
  echo "building CPython 3.12 into /tmp/py312 (about ten minutes)"
  mkdir -p /tmp/py312-src && cd /tmp/py312-src
  curl -sSfO http://archive.ubuntu.com/ubuntu/pool/main/p/python3.12/python3.12_3.12.3.orig.tar.xz
  tar -xf python3.12_3.12.3.orig.tar.xz && cd Python-3.12.3
  ./configure -q --prefix=/tmp/py312 --with-ensurepip=install > configure.log
  make -s -j"$(nproc)" > make.log 2>&1 && make -s install > install.log 2>&1
  cd "$repo"
  py=/tmp/py312/bin/python3.12
fi

mkdir -p "$work"
dev=python
[ -x .venv/bin/python ] && dev=.venv/bin/python
if [ ! -x "$work/image/bin/python3" ]; then
  requirements=$("$dev" bench/device/stage.py --for run --image-requirements)
  if [ -z "$requirements" ]; then
    echo "stage.py found no marin-rl installed in $dev's environment: activate the dev venv" >&2
    exit 2
  fi
  "$py" -m venv "$work/image"
  "$work/image/bin/pip" install -q --no-deps $requirements
fi
# A fresh cache, as there: SmolLM2's checkpoint is converted again, JAX compiles again.
export PATH=$work/image/bin:$PATH RAY_TMPDIR=${RAY_TMPDIR:-$work/ray} XDG_CACHE_HOME=$work/cache
mkdir -p "$RAY_TMPDIR"
rm -rf /tmp/stage /tmp/site "$XDG_CACHE_HOME"
converted=${HOME}/.cache/marinrl/smollm2-135m-instruct
if ! python3 -c 'import torch' 2> /dev/null && [ -d "$converted" ]; then
  # transformers reads the GGUF's tokenizer only with torch, which the image has and this
  # stand-in lacks: take this machine's converted checkpoint instead.
  echo "no torch in the stand-in: SmolLM2's checkpoint copied from $converted"
  mkdir -p "$XDG_CACHE_HOME/marinrl" && cp -r "$converted" "$XDG_CACHE_HOME/marinrl/"
fi
parts=$(ls -d .stage/[0-9]* | wc -l)
for n in $(seq 1 "$parts"); do
  rm -rf "$work/tree" && mkdir -p "$work/tree/.stage"
  git ls-files -z -co --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$work/tree"
  cp -r ".stage/$n" "$work/tree/.stage/"
  set +e
  (cd "$work/tree" && bash bench/device/staged.sh true)
  rc=$?
  set -e
  if [ "$n" -lt "$parts" ] && [ "$rc" -ne 3 ]; then
    echo "call $n of $parts: staged.sh exited $rc, not 3" >&2; exit 1
  fi
  if [ "$n" -eq "$parts" ] && [ "$rc" -ne 0 ]; then
    echo "call $n of $parts (the install): staged.sh exited $rc" >&2; exit 1
  fi
done
rm -rf "$work/tree/.stage"
cd "$work/tree"
if [ $# -eq 0 ]; then
  set -- marinrl run --loss rloo --env math --set trainer.num_train_steps=50
fi
exec bash bench/device/staged.sh "$@"
