#!/bin/bash
# The open issues' GPU figures in one device call (bench/device/README.md), after staged.sh:
#   bash bench/device/staged.sh bash bench/device/all.sh
# Each bench is bounded by `timeout` so the next still runs; logs go to $OUT (or /tmp/out).
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -c 'import jax; print(jax.devices())' 2>&1 | tail -1
# 1. Generation, issue 48: every engine side by side (paged and dense only on cells they finish
#    in time, the plain JAX loop at 32 x 128 only: it compiles once per cell). On its time limit
#    it still prints the table of the cells it measured.
timeout 220 python3 bench/generation.py --layers 28 --rows 32 64 256 --tokens 128 512 \
  --engines kv paged dense \
  --limit paged=8192 --limit dense=8192 --limit plain=4096 2>&1 | grep -v -i "warning" \
  | tee "$out/generation.log"
# 2. A real model learning, colocated, issue 49.
timeout 240 python3 bench/real_model.py --steps 10 2>&1 | tail -40 | tee "$out/real_model.log"
# 3. The agent endpoint, issue 48 (its programs in 8 env processes; 98 s on the 2-core CPU).
timeout 100 bash -c 'cd bench && python3 agent_endpoint.py --processes 8 --batches 3 --warm-up 2' \
  2>&1 | grep -v -i "warning" | tail -20 | tee "$out/agent_endpoint.log"
# 4. The kv engine's attention against jax.nn.dot_product_attention (xla, cudnn), issue 48's
#    "where that is faster, measured".
timeout 30 python3 bench/attention.py --rows 32 256 --windows 256 1024 2>&1 \
  | grep -v -i "warning" | tail -12 | tee "$out/attention.log"
# 5. Issue 61: a Qwen3-8B-shaped model (random bf16 weights, written first: ~16 GB) with LoRA,
#    colocated on the one GPU: steps/s, the peak device memory beside the memory check's
#    estimate printed before start. Not yet run on a GPU; with items 1-4 it passes the 15
#    minutes of one session's device time, so run it alone (`bash bench/device/staged.sh bash -c
#    "sed -n '/^# 5\./,\$p' bench/device/all.sh | bash"`) when 1-4's figures are recorded.
timeout 420 python3 bench/scale.py --shape qwen3-8b --lora 16 --colocate --skip-figures \
  --steps 3 --batch 16 --seq 512 --max-tokens 128 2>&1 | grep -v -i "warning" | tail -30 \
  | tee "$out/lora_8b.log"
