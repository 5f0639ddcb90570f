#!/bin/bash
# bench/agent_endpoint.py on the lent GPU machine, after bench/device/wheels.sh here. The whole
# device command (run's carry: [".whl"]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && bash bench/device/agent_endpoint.sh [ARGS...]
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/bench/device/stub
nvidia-smi --query-gpu=name --format=csv,noheader
cd bench && python3 agent_endpoint.py "$@" 2>&1 | grep -v -i "warning\|sqrt"
