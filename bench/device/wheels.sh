#!/bin/bash
# Wheels for the lent GPU machine (its image: Python 3.12, jax 0.11.2 with CUDA, torch,
# transformers 5, aiohttp; no levanter, haliax, openai, Ray): what the single-process benches
# import and the image lacks, at this venv's versions, into .whl/ (ignored by git: add
# `/.whl/` to .git/info/exclude), plus marin-rl itself. Ray does not travel (too large);
# bench/device/stub stands in for it and restores jax.core.is_constant_dim for haliax.
#
#   . venv/bin/activate && bash bench/device/wheels.sh
#   then, on the device (run's carry: [".whl"]), see bench/device/agent_endpoint.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
names="GitPython annotated-types aqtp async-lru braceexpand cachebox cattrs dataclasses-json
datasets deepdiff dill distro draccus gitdb google-api-core google-auth google-cloud-core
google-cloud-storage google-cloud-storage-control google-resumable-media googleapis-common-protos
grpc-google-iam-v1 haliax humanfriendly jiter jmp jsonpointer jsonschema jsonschema-specifications
levanter marshmallow mergedeep multiprocess openai orderly-set pydantic pydantic_core pytimeparse
pytz referencing rfc3339-validator rpds-py smmap sniffio tblib tqdm-loggable typing-inspection
zstandard equinox optax chex jaxtyping wadler_lindig flax transformers huggingface_hub tokenizers"
# shellcheck disable=SC2086
pins=$(python -c 'import importlib.metadata as m, sys; print(*(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' $names)
mkdir -p .whl
# shellcheck disable=SC2086
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl $pins
rm -f .whl/marin_rl-*.whl
python -m pip wheel -q --no-deps -w .whl .
du -sh .whl  # the device takes 64 MiB with the working tree
