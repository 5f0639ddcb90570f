"""The rollout side's coordinating half: weight sync, metadata, storage, logging, the loop.

:class:`RolloutWorker` delegates all inference, env and curriculum work to a
:class:`~marin_rl_core.rollout_manager.RolloutManager` and does the I/O around it: it pulls newer
weights before every batch, tags each batch with its ``weight_step`` and ``worker_id`` (through
the manager's stateless arguments), writes batches to rollout storage (blocking while storage is
full), and logs metrics. Worker 0 also runs the periodic held-out evaluation every
``eval.frequency`` trainer steps, so the eval curve is measured once, on fixed problems.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from marin_rl_core.config import RLJobConfig
from marin_rl_core.protocols import CurriculumPolicy, RolloutWriter, WeightTransferClient
from marin_rl_core.registry import Registry
from marin_rl_core.rollout_manager import RolloutManager
from marin_rl_core.types import RolloutBatch

logger = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 7_919
"""Eval problems come from this seed offset: the same held-out problems at every eval."""


class RolloutWorker:
    """See the module docstring.

    Args:
        config: the resolved run config.
        registry: the loaded plugins.
        worker_index: 0..num_rollout_workers-1; worker 0 evaluates.
        writer: rollout storage's writer end.
        weight_client: pulls weights from the trainer; ``None`` keeps the initial weights.
        curriculum: the shared curriculum (a local policy or a proxy to the job's actor).
        log: ``log(metrics, step=..., source=...)``.
    """

    def __init__(
        self,
        config: RLJobConfig,
        registry: Registry,
        *,
        worker_index: int,
        writer: RolloutWriter,
        weight_client: WeightTransferClient | None,
        curriculum: CurriculumPolicy,
        log: Callable[..., Any] | None = None,
    ):
        from marin_rl_core.tokenizer import model_tokenizer
        from marin_rl_core.trainer import initial_model

        self.config = config
        self.worker_index = worker_index
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-w{worker_index}"
        self.writer = writer
        self.weight_client = weight_client
        self.curriculum = curriculum
        self._log = log or (lambda metrics, *, step, source: None)
        self._stop = threading.Event()
        tokenizer = model_tokenizer(config.model)
        self.manager = RolloutManager(
            config,
            registry,
            model=initial_model(config, tokenizer),
            tokenizer=tokenizer,
            curriculum=curriculum,
        )
        self.weight_step = -1  # nothing received yet
        self.weight_syncs = 0
        self.batches_written = 0
        self._next_eval = 0

    # --- weights ------------------------------------------------------------------------------

    def sync_weights(self) -> bool:
        """Swap in newer weights if the trainer published some; returns whether it did."""
        if self.weight_client is None:
            if self.weight_step < 0:
                self.weight_step = 0
            return False
        received = self.weight_client.receive(self.manager.model)
        if received is None:
            return False
        model, step = received
        self.manager.update_model(model)
        self.weight_step = int(step)
        self.weight_syncs += 1
        logger.info("worker %s: now sampling with weights of step %d", self.worker_id, step)
        return True

    def wait_for_weights(self, min_step: int, *, timeout: float = 600.0) -> bool:
        """Block until weights of at least ``min_step`` arrive (or stop/timeout)."""
        deadline = time.monotonic() + timeout
        while self.weight_step < min_step and not self._stop.is_set():
            if not self.sync_weights():
                if time.monotonic() > deadline:
                    return False
                self._stop.wait(0.05)
        return self.weight_step >= min_step

    # --- the loop -----------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    def _seed(self, counter: int) -> int:
        return (self.config.seed * 1_000_003 + self.worker_index * 10_007 + counter) % (2**31 - 1)

    def evaluate(self) -> dict[str, float]:
        """Full held-out eval of every lesson with the current weights; logs and returns it."""
        step = max(self.weight_step, 0)
        results = self.manager.evaluate_curriculum(
            n_examples=self.config.eval.n_examples,
            seed=self.config.seed + EVAL_SEED_OFFSET,
            step=step,
            weight_step=step,
            worker_id=self.worker_id,
        )
        metrics: dict[str, Any] = {}
        for lesson_id, (stats, _) in results.items():
            metrics[f"eval/{lesson_id}/reward"] = stats.mean_reward
            metrics[f"eval/{lesson_id}/n"] = stats.n_rollouts
            for name, value in stats.metrics.items():  # the env's Score metrics
                metrics[f"eval/{lesson_id}/{name}"] = value
        for lesson_id, state in self.curriculum.lesson_states().items():
            metrics[f"curriculum/{lesson_id}/state"] = state
        self._log(metrics, step=step, source="eval")
        logger.info(
            "eval at step %d: %s", step, {k: v for k, v in metrics.items() if k.endswith("/reward")}
        )
        return metrics

    def _write(self, batch: RolloutBatch) -> bool:
        while not self._stop.is_set():
            try:
                self.writer.write_batch(batch, timeout=1.0)
                return True
            except TimeoutError:
                continue  # storage is full: the trainer is behind; keep trying until stopped
        return False

    def run(self, *, max_batches: int | None = None) -> dict[str, int]:
        """Generate and ship rollout batches until stopped; returns counters."""
        self.wait_for_weights(0)
        counter = 0
        eval_every = self.config.eval.frequency
        while not self._stop.is_set() and (max_batches is None or counter < max_batches):
            self.sync_weights()
            if self.worker_index == 0 and self.weight_step >= self._next_eval:
                self.evaluate()
                self._next_eval = (
                    (self.weight_step // eval_every + 1) * eval_every if eval_every else 1 << 62
                )
            lesson_id = self.curriculum.sample_lesson(seed=self._seed(counter))
            sampling = self.config.sampling_for(self.manager.lessons[lesson_id])
            micro = self.config.eval.micro_frequency
            if micro and counter and counter % micro == 0:
                stats, _ = self.manager.evaluate_lesson(
                    lesson_id,
                    n_examples=self.config.eval.micro_n_examples,
                    eval_type="micro_eval",
                    seed=self._seed(counter) + 1,
                    step=self.weight_step,
                    weight_step=self.weight_step,
                    worker_id=self.worker_id,
                )
                self._log(
                    {
                        f"micro_eval/{lesson_id}/reward": stats.mean_reward,
                        **{f"micro_eval/{lesson_id}/{k}": v for k, v in stats.metrics.items()},
                    },
                    step=self.weight_step,
                    source="rollout",
                )
            batch, metrics = self.manager.sample_batch(
                lesson_id,
                n_examples=sampling.n_prompts,
                n_generations=sampling.n_generations_per_prompt,
                mode="train",
                seed=self._seed(counter),
                weight_step=self.weight_step,
                worker_id=self.worker_id,
            )
            counter += 1
            if batch is not None:
                self.manager.update_training_stats(lesson_id, batch, self.weight_step)
                if self._write(batch):
                    self.batches_written += 1
            metrics = {f"rollout/{k}": v for k, v in metrics.items()}
            metrics["rollout/lesson"] = lesson_id
            metrics["rollout/worker"] = self.worker_index
            metrics["rollout/weight_syncs"] = self.weight_syncs
            self._log(metrics, step=max(self.weight_step, 0), source="rollout")
        return self.counters()

    def counters(self) -> dict[str, int]:
        return {
            "batches_written": self.batches_written,
            "weight_syncs": self.weight_syncs,
            "weight_step": self.weight_step,
        }

    def final_eval(self, final_step: int, *, timeout: float = 600.0) -> dict[str, float]:
        """After training: wait for the final weights, then evaluate every lesson."""
        self._stop.clear()
        self.wait_for_weights(final_step, timeout=timeout)
        return self.evaluate()
