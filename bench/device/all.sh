#!/bin/bash
# The GPU figures in one device call (bench/device/README.md), after staged.sh:
#   bash bench/device/staged.sh bash bench/device/all.sh
# The open issues' figures first (issue 61), then those of issues resolved on the CPU whose GPU
# figures were never measured (48, 49) while time is left. Each bench runs under `timeout`, cut
# to the time left of the call's budget (BUDGET_S, default 570 s of the call's 600), and one
# that would have less than it needs is skipped, saying so: the call ends before its limit and
# its logs come back. SKIP="1 3" leaves items 1 and 3 out. Logs go to $OUT (or /tmp/out).
out=${OUT:-/tmp/out}
mkdir -p "$out"
end=$((SECONDS + ${BUDGET_S:-570}))

# bounded ITEM WANT LEAST CMD...: CMD under `timeout` of WANT seconds or the time left, if
# less; skipped when ITEM is in $SKIP or under LEAST seconds are left.
bounded() {
  local item=$1 want=$2 least=$3 left=$((end - SECONDS))
  shift 3
  if [[ " ${SKIP:-} " == *" $item "* ]]; then
    echo "skipped (SKIP=${SKIP}): $*"
    return 0
  fi
  if ((left < least)); then
    echo "skipped, ${left} s of the call's budget left (it needs ${least}): $*"
    return 0
  fi
  timeout $((want < left ? want : left)) "$@"
}

python3 -c 'import jax; print(jax.devices())' 2>&1 | tail -1
# 1. Issue 61: a Qwen3-8B-shaped model (random bf16 weights, written first: ~16 GB) with LoRA,
#    colocated on the one GPU: steps/s, generation share, the peak device memory beside the
#    memory check's estimate printed before start (for docs/colocation.md). Not yet run on a GPU.
bounded 1 420 300 python3 bench/scale.py --shape qwen3-8b --lora 16 --colocate --skip-figures \
  --skip-export --steps 3 --batch 16 --seq 512 --max-tokens 128 2>&1 | grep -v -i "warning" \
  | tail -30 | tee "$out/lora_8b.log"
# 2. The kv engine's attention against jax.nn.dot_product_attention (xla, cudnn), issue 48's
#    "where that is faster, measured".
bounded 2 30 20 python3 bench/attention.py --rows 32 256 --windows 256 1024 2>&1 \
  | grep -v -i "warning" | tail -12 | tee "$out/attention.log"
# 3. Generation, issue 48: every engine side by side (paged and dense only on cells they finish
#    in time, the plain JAX loop at 32 x 128 only: it compiles once per cell). On its time limit
#    it still prints the table of the cells it measured.
bounded 3 220 60 python3 bench/generation.py --layers 28 --rows 32 64 256 --tokens 128 512 \
  --engines kv paged dense \
  --limit paged=8192 --limit dense=8192 --limit plain=4096 2>&1 | grep -v -i "warning" \
  | tee "$out/generation.log"
# 4. A real model learning, colocated, issue 49.
bounded 4 240 150 python3 bench/real_model.py --steps 10 2>&1 | tail -40 | tee "$out/real_model.log"
# 5. The agent endpoint, issue 48 (its programs in 8 env processes; 98 s on the 2-core CPU).
bounded 5 100 90 bash -c 'cd bench && python3 agent_endpoint.py --processes 8 --batches 3 --warm-up 2' \
  2>&1 | grep -v -i "warning" | tail -20 | tee "$out/agent_endpoint.log"
