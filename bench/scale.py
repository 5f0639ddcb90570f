"""A real model's shape: Qwen3-0.6B trained by marinrl on this machine, measured side by side.

The checkpoint has the exact configuration of Qwen3-0.6B (596M parameters, 28 layers, hidden
size 1024, 16 query and 8 key/value heads of 128, its real 151,936-row vocabulary, tied
embeddings, RoPE theta 1e6, bf16 weights) with random weights, written here by ``transformers``
with a small tokenizer that has Qwen's ChatML template (nothing is downloaded). Then:

1. **Learner**, in a process of its own per device count (``--devices 1 4``: 4 simulated CPU
   devices, the trainer's default FSDP mesh): the RL step (``rloo`` with its default KL
   penalty, as the trainer builds it) against levanter's own cross-entropy step of the same
   batch (target <= 1.3x, plus one reference forward when KL is on); XLA's peak memory of each
   compiled step (target RL <= 1.2x CE); the compiled RL step's constants (frozen models are
   arguments); the loss of the first RL step (the same on every device count) and the memory
   per device (falling with the device count).
2. **Sampler** (1 device): generated tokens/s of marinrl's ``sample_batch`` against levanter's
   bare ``InferenceEngine`` on the same prompts (target >= 0.9x).
3. **The job**: ``marinrl run --model DIR`` for a few RL steps (Ray, trainer and rollout worker
   processes, the peak resident memory of each), then ``marinrl export`` (``--skip-export``:
   not; a lent GPU's minutes go to the job's figures).

Parts 1 and 2 need no Ray: on a GPU, ``python bench/scale.py --devices 1 --skip-job`` prints the
same figures plus model FLOPs utilisation (``--peak-tflops``: the accelerator's dense bf16 peak).

    python bench/scale.py                       # everything, 1 and 4 devices (~30 min, 2 cores)
    python bench/scale.py --devices 1 --skip-job
    python bench/scale.py --shape qwen3-1.7b --lora 16 --colocate --skip-figures   # issue 61

``--shape`` picks Qwen3-0.6B (default), -1.7B or -8B; ``--lora RANK`` and ``--colocate`` set the
job's ``model.lora.rank`` and ``resources.colocate``, and the job part prints the memory check's
estimate (printed before start) against the peak resident memory of the job's processes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

QWEN3_0_6B = dict(
    vocab_size=151_936,
    hidden_size=1024,
    intermediate_size=3072,
    num_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40_960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
)
"""Qwen3-0.6B's ``config.json`` (its tied embeddings are ``write_tiny_hf_checkpoint``'s default
for Qwen3)."""
SHAPES = {
    "qwen3-0.6b": QWEN3_0_6B,
    # 1.72B parameters, tied embeddings.
    "qwen3-1.7b": {**QWEN3_0_6B, "hidden_size": 2048, "intermediate_size": 6144},
    # 8.2B parameters, untied embeddings.
    "qwen3-8b": {
        **QWEN3_0_6B, "hidden_size": 4096, "intermediate_size": 12288, "num_layers": 36,
        "num_attention_heads": 32, "tie_word_embeddings": False,
    },
}  # fmt: skip
"""The ``--shape`` s: Qwen3 models' ``config.json`` s."""


def write_checkpoint(path: Path, *, shape: str, layers: int) -> Path:
    from marin_rl_core.tiny_checkpoints import write_tiny_hf_checkpoint

    if (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists():
        return path
    print(f"writing a {shape}-shaped checkpoint ({layers} layers) to {path} ...", flush=True)
    fields = {**SHAPES[shape], "num_layers": layers}
    return write_tiny_hf_checkpoint(path, "qwen3", dtype="bfloat16", **fields)


def job_overrides(args: argparse.Namespace) -> list[str]:
    """The run settings every part uses: one lesson of chat prompts, ``--batch`` rollouts of
    ``--max-tokens`` tokens per step in rows of ``--seq``."""
    return [
        f'model.checkpoint="{args.checkpoint}"',
        f"model.max_seq_len={args.seq}",
        f"trainer.batch_size={args.batch}",
        "sampling.n_prompts=2",
        f"sampling.n_generations_per_prompt={args.batch // 2}",
        f"sampling.max_tokens={args.max_tokens}",
        f"eval.sampling.max_tokens={args.max_tokens}",
        "eval.n_examples=2",
        'curriculum.lessons=[{id = "add", env_config = {task = "add_1digit"}}]',
        *args.overrides,
    ]


# --- parts 1 and 2: in a process of their own ----------------------------------------------------


def figures(args: argparse.Namespace) -> None:
    """Learner figures (and, on one device, sampler figures) as JSON in ``args.json``."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    import jax
    import numpy as np

    sys.path.insert(0, str(Path(__file__).parent))
    from step_time import compare_rollouts, compare_steps

    from marin_rl_core import build_registry
    from marin_rl_core.config import resolve_config
    from marin_rl_core.learner.training_batch import training_batch_from_rollouts
    from marin_rl_core.models.build import initial_model
    from marin_rl_core.models.tokenizer import encode_prompt, model_tokenizer
    from marin_rl_core.types import Problem, Rollout

    if jax.devices()[0].platform == "cpu":
        assert jax.device_count() == args.devices, jax.devices()
    registry = build_registry()
    config = resolve_config(registry, overrides=job_overrides(args))
    tokenizer = model_tokenizer(config.model)
    out: dict = {}
    if args.devices == 1:
        from marin_rl_core.rollout.manager import RolloutManager

        sampler_config = resolve_config(
            registry, overrides=[*job_overrides(args), 'engine.name="paged"']
        )
        model = initial_model(
            sampler_config, tokenizer, dtype=sampler_config.model.resolved_inference_dtype
        )
        manager = RolloutManager(sampler_config, registry, model=model, tokenizer=tokenizer)
        rollouts = compare_rollouts(manager, sampler_config, "add", calls=4)
        rollouts.pop("batch")
        out["rollouts"] = rollouts
        manager.shutdown()
        del manager, model
    # A fixed batch (the same on every device count): chat prompts and random responses that
    # fill the rows, as a long answer would.
    rng = np.random.default_rng(0)
    batch = []
    for i in range(args.batch):
        prompt = np.asarray(encode_prompt(tokenizer, Problem(id=str(i), prompt=f"{i}+{i}=")))
        response = rng.integers(4, 150, size=args.seq - prompt.size).astype(np.int32)
        batch.append(
            Rollout.single_turn(
                env_name="math", lesson_id="add", problem_id=str(i),
                prompt_tokens=prompt.astype(np.int32), response_tokens=response,
                response_logprobs=-rng.uniform(1, 12, size=response.size).astype(np.float32),
                reward=float(i % 2),
            )
        )  # fmt: skip
    tb = training_batch_from_rollouts(
        batch, np.linspace(-1, 1, args.batch), args.seq, tokenizer.pad_id,
        temperature=config.sampling.temperature, batch_size=args.batch,
    )  # fmt: skip
    model = initial_model(config, tokenizer)
    steps = compare_steps(config, registry, model, tb, repeats=args.repeats, rounds=1)
    steps["sizes"] = dict(steps["sizes"])
    steps["parameters"] = int(
        sum(x.size for x in jax.tree.leaves(model) if hasattr(x, "size") and x.ndim)
    )
    steps["platform"] = jax.devices()[0].platform
    out["steps"] = steps
    Path(args.json).write_text(json.dumps(out))


class PeakMemory:
    """The peak resident memory of a process and its children, sampled every 0.2 s; the peak of
    each child process by the actor a marinrl job runs in it (``TrainerService``, the colocated
    trainer and sampler's included, and ``RolloutService``)."""

    def __init__(self, pid: int):
        import psutil

        self.root = psutil.Process(pid)
        self.total = 0
        self.by_role: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                return
            total = 0
            for p in procs:
                try:
                    rss = p.memory_info().rss
                    title = " ".join(p.cmdline())
                except psutil.Error:
                    continue
                total += rss
                for role, name in (
                    ("TrainerService", "TrainerService"),
                    ("TrainerService", "ColocatedService"),  # trainer and sampler in one
                    ("RolloutService", "RolloutService"),
                ):
                    if name in title:
                        self.by_role[role] = max(self.by_role.get(role, 0), rss)
            self.total = max(self.total, total)
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_measured(
    command: list[str],
    env: dict | None = None,
    lines: list[str] | None = None,
    *,
    own_group: bool = False,
) -> tuple[int, float, PeakMemory]:
    """Run ``command``, sampling its processes' resident memory; its output is printed as it
    comes and, with ``lines``, kept there. ``own_group``: the command runs in a process group of
    its own, killed whole at once on ``timeout``'s SIGTERM or a Ctrl-C (a compiled JAX call runs
    to its end before Python sees a signal), and the bench stops with what it printed;
    otherwise (``marinrl run``) the command shares this group and stops as it does."""
    import signal

    start = time.monotonic()
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=own_group,
    )  # fmt: skip
    peak = PeakMemory(proc.pid)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if own_group else None
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            print(line, end="", flush=True)
            if lines is not None:
                lines.append(line)
        code = proc.wait()
    except KeyboardInterrupt:
        if not own_group:
            raise
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        sys.exit("stopped (time limit or Ctrl-C): the figures above are those measured")
    finally:
        peak.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return code, time.monotonic() - start, peak


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--batch", type=int, default=8, help="rollouts per training step")
    parser.add_argument("--seq", type=int, default=64, help="model.max_seq_len")
    parser.add_argument("--max-tokens", type=int, default=8, help="sampled tokens per rollout")
    parser.add_argument("--steps", type=int, default=3, help="RL steps of the marinrl job")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps of each learner")
    parser.add_argument("--peak-tflops", type=float, default=0.0)
    parser.add_argument("--skip-job", action="store_true")
    parser.add_argument("--skip-figures", action="store_true", help="only the marinrl job")
    parser.add_argument(
        "--skip-export", action="store_true", help="no marinrl export after the job"
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument(
        "--lora", type=int, default=0, metavar="RANK", help="the job trains LoRA adapters"
    )
    parser.add_argument(
        "--colocate", action="store_true", help="the job's trainer and sampler in one process"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="fewer layers of the same width and vocabulary (the 4-device comparison of the "
        "whole 28 layers needs more than 24 GiB of host memory: 4 simulated devices share it)",
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--part", choices=["figures"], help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    full = SHAPES[args.shape]["num_layers"]
    args.layers = args.layers or full
    layers = "" if args.layers == full else f"-{args.layers}-layers"
    args.checkpoint = args.checkpoint or cache / "marinrl" / f"bench-{args.shape}{layers}"
    if args.part == "figures":
        args.devices = args.devices[0]
        figures(args)
        return

    write_checkpoint(args.checkpoint, shape=args.shape, layers=args.layers)
    results: dict[int, dict] = {}
    for devices in [] if args.skip_figures else args.devices:
        out = Path(tempfile.mkdtemp(prefix="marinrl-scale-")) / "figures.json"
        command = [
            sys.executable, __file__, "--part", "figures", "--devices", str(devices),
            "--checkpoint", str(args.checkpoint), "--batch", str(args.batch),
            "--seq", str(args.seq), "--max-tokens", str(args.max_tokens),
            "--repeats", str(args.repeats), "--json", str(out),
        ] + [f"--set={o}" for o in args.overrides]  # fmt: skip
        print(f"\n== learner{' and sampler' if devices == 1 else ''} on {devices} device(s)")
        code, seconds, peak = run_measured(command, own_group=True)
        if code:
            sys.exit(f"the figures process on {devices} device(s) failed (exit {code})")
        results[devices] = json.loads(out.read_text())
        results[devices]["process_peak_rss"] = peak.total
        report(args, devices, results[devices], seconds)
    if len(results) > 1:
        one, many = results[min(results)], results[max(results)]
        print(f"\n== {min(results)} against {max(results)} devices")
        print(
            f"first RL step's loss     {one['steps']['rl_first_loss']:.6f} against "
            f"{many['steps']['rl_first_loss']:.6f}"
        )
        print(
            f"RL step memory per device {gib(one['steps']['rl_peak_bytes'])} against "
            f"{gib(many['steps']['rl_peak_bytes'])} "
            f"({many['steps']['rl_peak_bytes'] / one['steps']['rl_peak_bytes']:.2f}x)"
        )
    if not args.skip_job:
        job(args)


def report(args: argparse.Namespace, devices: int, got: dict, seconds: float) -> None:
    s = got["steps"]
    rl, ce, fwd = s["rl_seconds"], s["ce_seconds"], s["reference_forward_seconds"]
    print(
        f"model {s['parameters'] / 1e6:.0f}M parameters, vocab {s['vocab']}, batch {s['rows']} x "
        f"{s['positions']}, mesh {s['sizes']}, precision {s['precision']}, {s['platform']}"
    )
    print(
        f"cross-entropy step       {ce:8.2f} s   RL step {rl:8.2f} s   reference forward {fwd:.2f} s"
    )
    print(f"RL / CE                  {rl / ce:8.2f}x")
    print(f"(RL - ref forward) / CE  {(rl - fwd) / ce:8.2f}x   (target <= 1.30x)")
    print(
        f"peak memory per device   CE {gib(s['ce_peak_bytes'])}, RL {gib(s['rl_peak_bytes'])}: "
        f"RL / CE {s['rl_peak_bytes'] / s['ce_peak_bytes']:.2f}x   (target <= 1.20x)"
    )
    print(
        f"step constants           {s['constant_bytes']} bytes, the largest "
        f"{s['largest_constant_bytes']} bytes"
    )
    tokens_per_second = s["tokens"] / rl
    print(f"RL step tokens/s         {tokens_per_second:8.1f}")
    if args.peak_tflops:
        flops = 6 * s["parameters"] * s["tokens"]  # + attention, small at these lengths
        print(f"model FLOPs utilisation  {flops / rl / (args.peak_tflops * 1e12):8.1%}")
    print(f"process peak RSS         {gib(got['process_peak_rss'])} ({seconds:.0f} s in all)")
    if "rollouts" in got:
        r = got["rollouts"]
        print(
            f"rollouts                 marinrl {r['tokens_per_second']:.1f} tokens/s, bare "
            f"engine {r['bare_tokens_per_second']:.1f} tokens/s: "
            f"{r['tokens_per_second'] / r['bare_tokens_per_second']:.2f}x   (target >= 0.90x)"
        )


def job(args: argparse.Namespace) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="marinrl-scale-job-"))
    command = [sys.executable, "-m", "marin_rl_core", "run", "--env", "math"]
    for override in [
        *job_overrides(args),
        f"trainer.num_train_steps={args.steps}",
        f'run_dir="{run_dir}"',
        "eval.frequency=1000",
        *([f"model.lora.rank={args.lora}"] if args.lora else []),
        *(["resources.colocate=true"] if args.colocate else []),
    ]:
        command += ["--set", override]
    command += ["--run-id", "qwen3"]
    what = f"{args.shape}, {'LoRA rank ' + str(args.lora) if args.lora else 'full fine-tuning'}"
    then = "" if args.skip_export else ", then marinrl export"
    print(f"\n== marinrl run ({args.steps} RL steps, {what}){then}")
    lines: list[str] = []
    code, seconds, peak = run_measured(command, lines=lines)
    trainer, rollout = (peak.by_role.get(r, 0) for r in ("TrainerService", "RolloutService"))
    sampler = (
        "sampling in the trainer's process (colocated)"
        if args.colocate and not rollout
        else f"rollout worker {gib(rollout)}"
    )
    print(
        f"marinrl run              exit {code} in {seconds:.0f} s; peak RSS: all processes "
        f"{gib(peak.total)}, trainer {gib(trainer)}, {sampler}"
    )
    estimates = [
        float(m.group(1))
        for m in (re.search(r"memory: the job needs about ([\d.]+) GiB", x) for x in lines)
        if m
    ]
    if estimates:  # the check's estimate covers the trainer's and the rollout workers' processes
        measured = (trainer + rollout) / 2**30
        print(
            f"memory estimate          {estimates[0]:.1f} GiB before start, measured peak RSS "
            f"of the job's processes {measured:.2f} GiB: estimate / measured "
            f"{estimates[0] / measured:.2f}   (target within 25%)"
        )
    if code:
        sys.exit(f"marinrl run failed: see {run_dir / 'qwen3' / 'driver.log'}")
    rows = [json.loads(line) for line in (run_dir / "qwen3" / "metrics.jsonl").open()]
    train = [r for r in rows if r["source"] == "train"]
    for r in train:
        print(
            f"  step {r['step']}: loss {r['loss']:.4f}, {r['step_seconds']:.1f} s training, "
            f"{r.get('wait_seconds', 0):.1f} s waiting for rollouts"
        )
    if len(train) > 1:
        span = train[-1]["time"] - train[0]["time"]
        print(f"steps/s                  {(len(train) - 1) / span:.4f}")
    device = [r["device_peak_memory_gib"] for r in rows if "device_peak_memory_gib" in r]
    if device:  # accelerators: a colocated process's row covers sampling too
        print(f"peak device memory       {max(device):.2f} GiB")
    if args.skip_export:
        return
    export = run_dir / "export"
    code, seconds, _ = run_measured(
        [sys.executable, "-m", "marin_rl_core", "export", str(run_dir / "qwen3"), str(export)]
    )
    print(f"marinrl export           exit {code} in {seconds:.0f} s -> {export}")


if __name__ == "__main__":
    main()
