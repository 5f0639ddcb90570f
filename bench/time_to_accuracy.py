"""Time to 0.8 held-out accuracy of the default job, on three seeds.

Runs ``marinrl run --loss rloo --env math`` (the embedded defaults, through ``RLJob`` exactly as
the CLI does) once per seed and prints, per seed: wall time and trainer step at which the
held-out exact-match accuracy on the default lesson first reached the target, the lowest
accuracy after that, the final accuracy, and the reward curve. The bar (issue 3): every seed
reaches 0.8 and stays at or above 0.75 to the end.

    python bench/time_to_accuracy.py [--seeds 0 1 2] [--lesson add_1digit] [--set KEY=VALUE ...]
    python bench/time_to_accuracy.py --runs runs/RUN_ID ...   # summarise finished runs instead

The multi-turn game (issue 10's bar: every seed reaches a held-out success rate of 0.8 within 15
minutes; a feedback-blind policy cannot pass 0.4)::

    python bench/time_to_accuracy.py --env guess --lesson guess_digit --max-seconds 900 \
        --set trainer.num_train_steps=1000

With ``--runs`` the wall time is the span of the run's ``metrics.jsonl`` (first to last row),
which leaves out Ray start-up; the seed is read from the run's ``config.toml``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any


def summarize(
    run_dir: Path, *, seed: int, wall: float | None, args: argparse.Namespace
) -> dict[str, Any]:
    """The bar's figures for one finished run; ``wall=None`` takes the span of its metrics."""
    from marin_rl_core.metrics import read_metrics

    key = f"eval/{args.lesson}/reward"
    rows = read_metrics(run_dir)
    t0 = rows[0]["time"]
    if wall is None:
        wall = rows[-1]["time"] - t0
    curve = [
        (r["step"], r["time"] - t0, r[key]) for r in rows if r["source"] == "eval" and key in r
    ]
    reached = next(((s, t) for s, t, v in curve if v >= args.target), None)
    after = [v for s, t, v in curve if reached and s >= reached[0]]
    return {
        "seed": seed,
        "run_dir": str(run_dir),
        "wall_seconds": round(wall, 1),
        "step_to_target": reached[0] if reached else None,
        "seconds_to_target": round(reached[1], 1) if reached else None,
        "min_after_target": min(after) if after else None,
        "final": curve[-1][2] if curve else None,
        "initial": curve[0][2] if curve else None,
        "ok": bool(reached)
        and min(after) >= args.floor
        and (args.max_seconds is None or reached[1] <= args.max_seconds),
        "curve": [(s, round(v, 3)) for s, _, v in curve],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs", nargs="+", default=[], help="summarise these finished runs")
    parser.add_argument("--env", default="math")
    parser.add_argument("--lesson", default="add_1digit")
    parser.add_argument(
        "--max-seconds", type=float, default=None, help="the target must be reached this soon"
    )
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--floor", type=float, default=0.75)
    parser.add_argument("--run-dir", default="")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    results = []
    if args.runs:
        for run in map(Path, args.runs):
            seed = int(tomllib.loads((run / "config.toml").read_text()).get("seed", 0))
            result = summarize(run, seed=seed, wall=None, args=args)
            results.append(result)
            print(json.dumps(result), flush=True)
    else:
        from marin_rl_core import build_registry
        from marin_rl_core.config import resolve_config
        from marin_rl_core.job import RLJob

        run_root = Path(args.run_dir or tempfile.mkdtemp(prefix="marinrl-bench-"))
        registry = build_registry()
        for seed in args.seeds:
            config = resolve_config(
                registry,
                selections={"loss": "rloo", "env": args.env},
                overrides=[
                    f"seed={seed}",
                    f'run_dir="{run_root}"',
                    f'run_id="seed{seed}"',
                    *args.overrides,
                ],
            )
            start = time.time()
            RLJob(config, registry).run(progress=False)
            result = summarize(
                run_root / f"seed{seed}", seed=seed, wall=time.time() - start, args=args
            )
            results.append(result)
            print(json.dumps(result), flush=True)

    print()
    print(
        f"{'seed':>4} {'start':>6} {'to ' + str(args.target):>16} {'min after':>9} {'final':>6} {'wall':>7}  ok"
    )
    for r in results:
        to = (
            f"{r['seconds_to_target']}s/step{r['step_to_target']}"
            if r["step_to_target"] is not None
            else "never"
        )
        low = r["min_after_target"]
        print(
            f"{r['seed']:>4} {r['initial']:>6.3f} {to:>16} {'-' if low is None else f'{low:.3f}':>9} "
            f"{r['final']:>6.3f} {r['wall_seconds']:>6.0f}s  {'yes' if r['ok'] else 'NO'}"
        )
    within = f" within {args.max_seconds:.0f} s" if args.max_seconds is not None else ""
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
