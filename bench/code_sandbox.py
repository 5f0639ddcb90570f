"""How fast does the code env's sandbox pool grade, and do hostile programs slow it down?

Grades HumanEval's 164 canonical solutions through the ``code`` env's episodes (the sandbox
pool, every program in its own sandbox) and prints executions per second; every one must pass.
Then grades them again with the hostile programs of ``code_sandbox.ATTACKS`` mixed in
(``--copies`` of each: loops, fork bombs, memory hogs, escapes) and prints both rates side by
side, with the extra wall time the attacks cost against their bound: each attack may hold one
of the pool's slots for at most its wall limit, so ``attacks x wall_seconds / workers``.
The bar (issue 31): all canonical solutions pass, every attack earns 0 and leaves nothing
behind, and the extra time stays within the bound.

    python bench/code_sandbox.py [--workers 0] [--wall-seconds 4] [--cpu-seconds 2] [--copies 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from marin_rl_plugins.code_env import CodeEnv, CodeEnvConfig, humaneval_rows
from marin_rl_plugins.code_sandbox import ATTACKS, ESCAPE_FILE, describe

from marin_rl_core import Action


async def grade(env: CodeEnv, jobs: list) -> tuple[list, float]:
    started = time.perf_counter()
    steps = await asyncio.gather(*[env.reset(p).step(Action(text=text)) for p, text in jobs])
    return steps, time.perf_counter() - started


def left_running() -> int:
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            count += "marinrl-sandbox-" in os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=0, help="0: the CPU count")
    parser.add_argument("--wall-seconds", type=float, default=4.0)
    parser.add_argument("--cpu-seconds", type=float, default=2.0)
    parser.add_argument("--copies", type=int, default=2, help="of each attack")
    args = parser.parse_args()

    env = CodeEnv(
        CodeEnvConfig(
            eval_fraction=0.0,
            sandbox_workers=args.workers,
            wall_seconds=args.wall_seconds,
            cpu_seconds=args.cpu_seconds,
        )
    )
    workers = env.pool.max_concurrent
    print(f"sandbox: {describe(env.pool.isolation)}; {workers} at once")
    solutions = {row["task_id"]: row["canonical_solution"] for row in humaneval_rows()}
    clean = [(p, solutions[p.id]) for p in env.train_problems]
    steps, clean_s = asyncio.run(grade(env, clean))
    failed = [p.id for (p, _), s in zip(clean, steps) if s.reward != 1.0]
    print(f"canonical solutions: {len(clean) - len(failed)}/{len(clean)} pass in {clean_s:.1f} s: "
          f"{len(clean) / clean_s:.1f} executions/s")  # fmt: skip

    attacks = [
        (env.train_problems[i % len(clean)], f"```python\n{code}```")
        for i, code in enumerate(list(ATTACKS.values()) * args.copies)
    ]
    mixed = clean + attacks
    steps, mixed_s = asyncio.run(grade(env, mixed))
    mixed_failed = [p.id for (p, _), s in zip(clean, steps) if s.reward != 1.0]
    attack_steps = steps[len(clean) :]
    rewarded = sum(s.reward for s in attack_steps)
    bound = len(attacks) * args.wall_seconds / workers
    extra = mixed_s - clean_s * len(mixed) / len(clean)
    print(f"with {len(attacks)} attacks mixed in: {len(mixed)} executions in {mixed_s:.1f} s: "
          f"{len(mixed) / mixed_s:.1f} executions/s (ratio {clean_s / mixed_s * len(mixed) / len(clean):.2f})")  # fmt: skip
    print(f"  extra wall time {extra:.1f} s; bound {bound:.1f} s "
          f"({len(attacks)} x {args.wall_seconds:g} s / {workers})")  # fmt: skip
    slowest = max(s.metrics["sandbox_seconds"] for s in attack_steps)
    print(f"  slowest attack held its slot {slowest:.1f} s (wall limit {args.wall_seconds:g} s); "
          f"attacks rewarded: {rewarded:g}; canonical failures: {len(mixed_failed)}; "
          f"processes left: {left_running()}; escape file: {os.path.exists(ESCAPE_FILE)}")  # fmt: skip
    ok = (
        not failed
        and not mixed_failed
        and rewarded == 0
        and extra <= bound
        and left_running() == 0
        and not os.path.exists(ESCAPE_FILE)
    )
    print("bar met" if ok else "BAR NOT MET")
    env.pool.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
