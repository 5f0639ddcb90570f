#!/bin/bash
# bench/generation.py on the lent GPU machine, after bench/device/wheels.sh here. The whole
# device command (run's carry: [".whl"]); the grid, Qwen3-0.6B's 28 layers, with
# transformers' generate beside the engines (torch and transformers are on the image):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && bash bench/device/generation.sh \
#     --layers 28 --rows 32 64 256 --tokens 128 512
# The paged engine is ~200 tok/s there: add `--engines kv` for a quick look, the full run takes
# minutes per paged cell (give it most of one call's 10 minutes, or drop --tokens 512).
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/bench/device/stub
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 bench/generation.py "$@" 2>&1 | grep -v -i "warning\|sqrt"
