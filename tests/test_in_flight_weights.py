"""New weights while a batch samples (issue 48, ``episodes.in_flight_weights``): a rollout
worker with a real weight server takes the trainer's newer weights mid-batch; its rollouts
record the weight steps they span (``weight_step`` the oldest, which the replay buffer counts
staleness from). That each token's logprob is the one of the weights that sampled it is the
engine's contract (``tests/test_inference.py``). The worker runs in a process of its own, as in
a job: ``python tests/test_in_flight_weights.py`` runs one with in-flight weights and one
without, one after the other, and prints what each saw."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import attrs
import jax
import numpy as np
import pytest

from marin_rl_core import EnvPlugin, Problem, Step, build_registry, hookimpl
from marin_rl_core.config import resolve_config

TURN_S = 0.4  # each env step's time: a batch of 4 turns spans several weight polls (0.5 s)


@attrs.frozen
class SlowTalkConfig:
    turns: int = 4


class SlowTalkEpisode:
    def __init__(self, turns: int):
        self.turns, self.turn = turns, 0

    async def step(self, action) -> Step:
        import asyncio

        await asyncio.sleep(TURN_S)
        self.turn += 1
        return Step(observation="!", reward=0.0, done=self.turn >= self.turns)


class SlowTalkEnv:
    def __init__(self, config: SlowTalkConfig):
        self.config = config

    def sample_problems(self, n, *, mode, seed):
        return [Problem(id=f"{seed}-{i}", prompt=f"{i % 10}+1=") for i in range(n)]

    def reset(self, problem):
        return SlowTalkEpisode(self.config.turns)


class slow_talk_plugin:
    @staticmethod
    @hookimpl
    def marinrl_register_envs():
        yield EnvPlugin(
            name="slow_talk", summary="test", config_class=SlowTalkConfig, build=SlowTalkEnv
        )


class Writer:
    def __init__(self):
        self.batches = []

    def write_batch(self, batch, *, timeout=None):
        self.batches.append(batch)


def _worker(in_flight: bool):
    from marin_rl_core.rollout.worker import RolloutWorker

    registry = build_registry(modules=[slow_talk_plugin])
    config = resolve_config(
        registry,
        selections={"env": "slow_talk", "weight_transfer": "arrow_flight"},
        overrides=[
            'engine.name="kv"',
            f"episodes.in_flight_weights={str(in_flight).lower()}",
            "episodes.max_turns=4",
            "model.max_seq_len=40",
            "sampling.max_tokens=4",
            "eval.sampling.max_tokens=4",
            "sampling.n_prompts=2",
            "sampling.n_generations_per_prompt=2",
            "trainer.batch_size=4",
            "replay_buffer.max_generated_per_trained=0",
            "eval.frequency=0",
        ],
    )
    transfer = registry.get("weight_transfer", "arrow_flight")
    transfer = transfer.build(config.weight_transfer.config)
    server = transfer.server()
    writer = Writer()
    worker = RolloutWorker(
        config,
        registry,
        worker_index=1,  # no held-out eval
        writer=writer,
        weight_client=transfer.client(server.address),
        curriculum=registry.get("curriculum", config.curriculum.name).build(
            config.curriculum.config, config.curriculum.lessons
        ),
    )
    return worker, server, writer


def _publishing(server, model, *, every: float, until: threading.Event):
    """The trainer's side: new weights (scaled a little more each time) every ``every`` s."""

    def run():
        step = 1
        while not until.wait(every):
            factor = 1 + 0.05 * step
            scaled = jax.tree.map(lambda x, f=factor: x * f if _float(x) else x, model)
            server.publish(scaled, weight_step=step)
            step += 1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _float(x) -> bool:
    return hasattr(x, "dtype") and np.issubdtype(x.dtype, np.floating)


def _scenario(in_flight: bool) -> dict:
    """One training batch of a rollout worker while a trainer publishes every 0.3 s: what it
    logged and what its rollouts record (run in a process of its own, as a worker runs)."""
    worker, server, writer = _worker(in_flight)
    logged = []
    worker._log = lambda metrics, *, step, source: logged.append(metrics)
    first = worker.manager.model
    server.publish(first, weight_step=0)
    done = threading.Event()
    try:
        assert worker.wait_for_weights(0, timeout=60)
        publisher = _publishing(server, first, every=0.3, until=done)
        start = time.monotonic()
        worker.run(max_batches=1)
        seconds = time.monotonic() - start
        done.set()
        publisher.join()
    finally:
        done.set()
        server.close()
        worker.manager.shutdown()
    (batch,) = writer.batches
    (row,) = [m for m in logged if "rollout/in_flight_swaps" in m]
    return {
        "seconds": seconds,
        "swaps": row["rollout/in_flight_swaps"],
        "frac_spanning": row["rollout/frac_spanning_weights"],
        "steps": [[r.metadata.weight_step, r.metadata.last_weight_step] for r in batch.rollouts],
        "worker_step": worker.weight_step,
    }


@pytest.fixture(scope="module")
def scenarios() -> dict:
    """Both scenarios' results, from one process (each process costs seconds to start)."""
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("in_flight", [True, False], ids=["in-flight", "between-batches"])
def test_new_weights_reach_a_batch_while_it_samples_only_when_asked(scenarios, in_flight):
    result = scenarios["in-flight" if in_flight else "between-batches"]
    assert result["seconds"] > 4 * TURN_S
    steps = result["steps"]
    spanning = [(first, last) for first, last in steps if last is not None]
    if not in_flight:
        # The batch's weights sampled all of it, however many steps were published meanwhile.
        assert result["swaps"] == 0 and not spanning
        assert {first for first, _ in steps} == {0}
        return
    assert result["swaps"] >= 1
    assert spanning and result["frac_spanning"] == len(spanning) / len(steps)
    # The batch began with step 0; episodes whose first action was sampled later begin later.
    assert all(0 <= first < last <= result["worker_step"] for first, last in spanning)


if __name__ == "__main__":
    print(json.dumps({"in-flight": _scenario(True), "between-batches": _scenario(False)}))
