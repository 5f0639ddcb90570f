"""Time to 0.8 held-out accuracy of the default job, on three seeds, from process start.

Runs ``marinrl run --loss rloo --env math`` (the embedded defaults) as a fresh process per seed,
and prints, per seed: the seconds from launching the process to the first held-out eval at or
above the target (issue 11's bar: the median of seeds 0, 1, 2), the seconds from launch to the
first completed training step (start-up; issue 11: under 10 s on a second run, compile cache
warm), rollouts generated per rollout trained, the lowest accuracy after reaching the target,
the final accuracy and the reward curve. The learning bar (issue 3): every seed reaches 0.8 and
stays at or above 0.75 to the end.

    python bench/time_to_accuracy.py [--seeds 0 1 2] [--lesson add_1digit] [--set KEY=VALUE ...]
    python bench/time_to_accuracy.py --loss grpo       # another loss on the same task
    python bench/time_to_accuracy.py --until-target    # stop each run at the target (a baseline)
    python bench/time_to_accuracy.py --runs runs/RUN_ID ...   # summarise finished runs instead

To compare two commits back to back, run this script from one checkout with ``--python`` of
the other's virtual environment (``--python /path/to/other/.venv/bin/python``): the job then
runs the other commit's code while the measurement stays the same.

The multi-turn game (issue 10's bar: every seed reaches a held-out success rate of 0.8 within 15
minutes; a feedback-blind policy cannot pass 0.4)::

    python bench/time_to_accuracy.py --env guess --lesson guess_digit --max-seconds 900 \
        --set trainer.num_train_steps=1000

With ``--runs`` times count from the run's first metrics row (process start is not recorded);
the seed is read from the run's ``config.toml``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics rows (a partial last line, still being written, is skipped)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def summarize(
    run_dir: Path,
    *,
    seed: int,
    launched: float | None,
    wall: float | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The bar's figures for one run. Times count from ``launched`` (the process start), or
    from the first metrics row when it is ``None`` (``--runs``)."""
    key = f"eval/{args.lesson}/reward"
    rows = read_rows(run_dir)
    t0 = rows[0]["time"] if launched is None else launched
    if wall is None:
        wall = rows[-1]["time"] - t0
    curve = [
        (r["step"], r["time"] - t0, r[key]) for r in rows if r["source"] == "eval" and key in r
    ]
    reached = next(((s, t) for s, t, v in curve if v >= args.target), None)
    after = [v for s, t, v in curve if reached and s >= reached[0]]
    first_step = next((r["time"] - t0 for r in rows if r["source"] == "train"), None)
    # Rollouts generated for training (every batch the workers made, stale or not) per rollout
    # a training batch used. Runs of versions without ``rollout/rollouts`` count full batches.
    config = tomllib.loads((run_dir / "config.toml").read_text())
    sampling = config.get("sampling", {})
    full_batch = sampling.get("n_prompts", 64) * sampling.get("n_generations_per_prompt", 4)
    generated = sum(
        r.get("rollout/rollouts", full_batch)
        for r in rows
        if r["source"] == "rollout" and "rollout/batch_index" in r
    )
    trained = sum(r.get("replay/sampled_rollouts", 0) for r in rows if r["source"] == "train")
    return {
        "seed": seed,
        "run_dir": str(run_dir),
        "wall_seconds": round(wall, 1),
        "startup_seconds": round(first_step, 1) if first_step is not None else None,
        "step_to_target": reached[0] if reached else None,
        "seconds_to_target": round(reached[1], 1) if reached else None,
        "generated_per_trained": round(generated / trained, 3) if trained else None,
        "min_after_target": min(after) if after else None,
        "final": curve[-1][2] if curve else None,
        "initial": curve[0][2] if curve else None,
        "ok": bool(reached)
        and min(after) >= args.floor
        and (args.max_seconds is None or reached[1] <= args.max_seconds),
        "curve": [(s, round(v, 3)) for s, _, v in curve],
    }


def run_seed(seed: int, run_root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Launch one run as its own process and wait for it (or for the target, with
    ``--until-target``: the run is then stopped with SIGTERM, as a user's ``kill`` would)."""
    run_id = f"seed{seed}"
    repeat = 1
    while (run_root / run_id).exists():  # the same seed again (a warm-cache start)
        repeat += 1
        run_id = f"seed{seed}-{repeat}"
    run_dir = run_root / run_id
    command = [
        args.python,
        "-m",
        "marin_rl_core",
        "run",
        "--loss",
        args.loss,
        "--env",
        args.env,
        "--run-id",
        run_id,
        "--set",
        f"seed={seed}",
        "--set",
        f"run_dir={json.dumps(str(run_root))}",
        "--set",
        "logging.progress=false",
    ]
    for override in args.overrides:
        command += ["--set", override]
    log = open(run_root / f"{run_id}.out", "w")
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    launched = time.time()
    # Not this checkout's directory: `python -m` and Ray's workers put the working directory
    # first on sys.path, which would run this checkout's code under another --python.
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=run_root)
    key = f"eval/{args.lesson}/reward"
    stopped = False
    while process.poll() is None:
        time.sleep(0.5)
        if args.until_target and not stopped:
            if any(r.get(key, -1) >= args.target for r in read_rows(run_dir)):
                process.send_signal(signal.SIGTERM)
                stopped = True
    wall = time.time() - launched
    log.close()
    if process.returncode not in (0, 130, 143) and not stopped:
        print(f"seed {seed}: the run exited {process.returncode}; see {log.name}", flush=True)
    return summarize(run_dir, seed=seed, launched=launched, wall=wall, args=args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs", nargs="+", default=[], help="summarise these finished runs")
    parser.add_argument("--env", default="math")
    parser.add_argument("--loss", default="rloo", help="the loss plugin (rloo, grpo, ...)")
    parser.add_argument("--lesson", default="add_1digit")
    parser.add_argument(
        "--max-seconds", type=float, default=None, help="the target must be reached this soon"
    )
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--floor", type=float, default=0.75)
    parser.add_argument("--run-dir", default="")
    parser.add_argument(
        "--until-target", action="store_true", help="stop each run once it reaches the target"
    )
    parser.add_argument(
        "--python", default=sys.executable, help="the interpreter (virtual env) that runs the job"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    results = []
    if args.runs:
        for run in map(Path, args.runs):
            seed = int(tomllib.loads((run / "config.toml").read_text()).get("seed", 0))
            result = summarize(run, seed=seed, launched=None, wall=None, args=args)
            results.append(result)
            print(json.dumps(result), flush=True)
    else:
        run_root = Path(args.run_dir or tempfile.mkdtemp(prefix="marinrl-bench-")).resolve()
        run_root.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:
            result = run_seed(seed, run_root, args)
            results.append(result)
            print(json.dumps(result), flush=True)

    print()
    print(
        f"{'seed':>4} {'start':>6} {'startup':>8} {'to ' + str(args.target):>16} "
        f"{'gen/trained':>11} {'min after':>9} {'final':>6} {'wall':>7}  ok"
    )
    for r in results:
        to = (
            f"{r['seconds_to_target']}s/step{r['step_to_target']}"
            if r["step_to_target"] is not None
            else "never"
        )
        low = r["min_after_target"]
        startup = "-" if r["startup_seconds"] is None else f"{r['startup_seconds']}s"
        ratio = "-" if r["generated_per_trained"] is None else f"{r['generated_per_trained']:.2f}"
        final = "-" if r["final"] is None else f"{r['final']:.3f}"
        initial = "-" if r["initial"] is None else f"{r['initial']:.3f}"
        print(
            f"{r['seed']:>4} {initial:>6} {startup:>8} {to:>16} {ratio:>11} "
            f"{'-' if low is None else f'{low:.3f}':>9} {final:>6} {r['wall_seconds']:>6.0f}s  "
            f"{'yes' if r['ok'] else 'NO'}"
        )
    times = [r["seconds_to_target"] for r in results]
    if all(t is not None for t in times):
        print(f"median seconds to {args.target} from process start: {statistics.median(times):.1f}")
    within = f" within {args.max_seconds:.0f} s" if args.max_seconds is not None else ""
    if not args.until_target:
        print(
            f"all seeds reached {args.target}{within} and stayed >= {args.floor}: "
            f"{all(r['ok'] for r in results)}"
        )
    for r in results:
        print(f"  seed {r['seed']} curve (step, {args.lesson}): {r['curve']}")
    for r in results:
        print(f"  seed {r['seed']}: {r['run_dir']}")


if __name__ == "__main__":
    main()
