"""The rollout side's coordinating half: weight sync, metadata, storage, logging, the loop.

:class:`RolloutWorker` delegates all inference, env and curriculum work to a
:class:`~marin_rl_core.rollout.manager.RolloutManager` and does the I/O around it: it pulls newer
weights before every batch, tags each batch with its ``weight_step`` and ``worker_id`` (through
the manager's stateless arguments), writes batches to rollout storage (blocking while storage is
full), and logs metrics. Worker 0 also runs the periodic held-out evaluation every
``eval.frequency`` trainer steps, so the eval curve is measured once, on fixed problems.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from marin_rl_core.config.schema import RLJobConfig
from marin_rl_core.errors import MarinRLError
from marin_rl_core.metrics import device_memory
from marin_rl_core.pacing import Pacer
from marin_rl_core.protocols import CurriculumPolicy, RolloutWriter, WeightTransferClient
from marin_rl_core.registry import Registry
from marin_rl_core.rollout.in_flight import polling_weights
from marin_rl_core.rollout.manager import RolloutManager
from marin_rl_core.types import ReceivedWeights, RolloutBatch

if TYPE_CHECKING:
    from marin_rl_core.models.lora import AdaptedBase

logger = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 7_919
"""Eval problems come from this seed offset: the same held-out problems at every eval."""


WORKER_SEED_STRIDE = 2**24
"""Batches a rollout worker may sample before its seeds would run into the next worker's."""


def batch_seed(run_seed: int, worker_index: int, batch_index: int, *, salt: int = 0) -> int:
    """The seed of a rollout worker's batch: its lesson draw, ``Env.sample_problems`` seed and
    sampling keys. The same in a resumed run as in an uninterrupted one; distinct across
    batches, and across workers for :data:`WORKER_SEED_STRIDE` batches each (up to 127
    workers). A restarted worker process adds a random ``salt``. For worker 0 this is the
    seed the default task was tuned with (``run_seed * 1_000_003 + batch_index``)."""
    return (run_seed * 1_000_003 + worker_index * WORKER_SEED_STRIDE + batch_index + salt) % (
        2**31 - 1
    )


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
        model: the initial weights (in the inference dtype); ``None`` reads them from the
            run's model (a colocated sampler is handed the trainer's).
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
        model: Any = None,
        samples: Callable[[list[dict[str, Any]]], Any] | None = None,
    ):
        import jax

        from marin_rl_core.models.build import initial_model
        from marin_rl_core.models.lora import AdaptedBase
        from marin_rl_core.models.tokenizer import model_tokenizer

        self.config = config
        self.worker_index = worker_index
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-w{worker_index}"
        self.writer = writer
        self.weight_client = weight_client
        self.curriculum = curriculum
        self._log = log or (lambda metrics, *, step, source: None)
        self._samples = samples or (lambda rows: None)  # eval samples: eval_samples.jsonl
        self._stop = threading.Event()
        tokenizer = model_tokenizer(config.model)
        # Read straight into the sampler's dtype: no float32 copy of a bfloat16 sampler's
        # weights (2.4 GB for a 0.6B model) is ever held. A colocated sampler is handed the
        # trainer's (``model``) and reads nothing.
        dtype = config.model.resolved_inference_dtype
        if model is None:
            model = initial_model(config, tokenizer, dtype=dtype)
        self.adapted: AdaptedBase | None = None
        """A LoRA job apart from its trainer: the base, that each adapters received merge into
        (a colocated sampler is handed the policy unmerged, on the trainer's own base)."""
        if config.model.lora.enabled and config.resources.colocate is not True:
            key = jax.random.PRNGKey(config.seed + 3)
            self.adapted = AdaptedBase(model, config.model.lora, dtype=dtype, key=key)
        self.manager = RolloutManager(
            config, registry, model=model, tokenizer=tokenizer, curriculum=curriculum
        )
        self.next_batch = 0
        """The counter of the next batch: with the run's seed and the worker index it fixes the
        batch's lesson, problems and sampling keys. A resumed run starts each worker after the
        last batch its checkpoint had received, so it draws what the run would have drawn."""
        self.seed_salt = 0
        """Mixed into every sampling seed: a random nonce in a rollout worker process that Ray
        restarted, so that it does not draw again what its dead predecessor drew."""
        self.warm_up_tokens: int | None = None
        """The most tokens of a rollout of the warm-up batch (``None``: no warm-up): the
        trainer warms its step up for rows of that length (the first batches' likely length)."""
        self.weight_step = -1  # nothing received yet
        self.weight_syncs = 0
        self.weight_errors = 0
        self.last_weight_error = ""
        self._received: list[ReceivedWeights] = []  # receives not yet in a metrics row
        self._weights_backoff = 0.0
        self._weights_retry_at = 0.0
        self.batches_written = 0
        self.batches_sampled = 0
        self.empty_batches_in_a_row = 0  # batches in which every problem was dropped
        self.prompts_too_long = 0
        self.env_errors = 0
        self.env_timeouts = 0
        self.write_errors = 0
        self._write_error_logged = -1e9
        self._next_eval = 0
        rb = config.replay_buffer
        self.pacer = Pacer(
            share=rb.max_generated_per_trained
            * config.trainer.batch_size
            / config.num_rollout_workers,
            delay=rb.max_rollout_step_delay,
            name=self.worker_id,
        )
        """When this worker waits for newer weights (:mod:`~marin_rl_core.pacing`); the
        job sets its ``ask``, the trainer's answer."""

    # --- weights ------------------------------------------------------------------------------

    def sync_weights(self) -> bool:
        """Swap in newer weights if the trainer published some; returns whether it did.

        A receive that fails (the weight server dead, wedged or unreachable) is logged, counted
        and tried again after a backoff (0.5 s doubling to 30 s) while the worker samples on
        with the weights it has; weights that do not fit the model
        (:class:`~marin_rl_core.errors.WeightMismatchError`) stop the worker."""
        if self.weight_client is None:
            if self.weight_step < 0:
                self.weight_step = 0
            return False
        now = time.monotonic()
        if now < self._weights_retry_at:
            return False
        try:
            like = self.manager.model if self.adapted is None else self.adapted.like
            received = self.weight_client.receive(like)
        except MarinRLError:
            raise
        except Exception as exc:  # noqa: BLE001 - a transfer failure: retried with backoff
            self.weight_errors += 1
            self._weights_backoff = min(max(0.5, 2 * self._weights_backoff), 30.0)
            self._weights_retry_at = time.monotonic() + self._weights_backoff
            self.last_weight_error = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            logger.warning(
                "worker %s: receiving weights failed (%s); sampling on with step %d, trying "
                "again in %.1f s",
                self.worker_id,
                self.last_weight_error,
                self.weight_step,
                self._weights_backoff,
            )
            return False
        self._weights_backoff = 0.0
        if received is None:
            return False
        step = received.weight_step
        self._received.append(received)
        model = received.model if self.adapted is None else self.adapted.merged(received.model)
        self.manager.update_model(model, weight_step=int(step))
        self.weight_step = int(step)
        self.pacer.weights_arrived()
        self.weight_syncs += 1
        logger.info("worker %s: now sampling with weights of step %d", self.worker_id, step)
        return True

    def _in_flight(self) -> Any:
        """While a training batch samples: newer weights every 0.5 s into an engine that takes
        them between decode rounds, if ``episodes.in_flight_weights`` asks for it
        (:mod:`~marin_rl_core.rollout.in_flight`); else nothing."""
        if not (
            self.config.episodes.in_flight_weights
            and self.manager.in_flight_weights
            and self.weight_client is not None
        ):
            return contextlib.nullcontext([0])
        return polling_weights(self.sync_weights, interval=0.5, name=self.worker_id)

    def _receive_metrics(self) -> dict[str, float]:
        """The weight receives since the last row (while sampling or waiting for weights):
        bytes and seconds summed, GB/s over them, and the largest version lag."""
        if not self._received:
            return {}
        received, self._received = self._received, []
        nbytes = sum(r.nbytes for r in received)
        seconds = sum(r.seconds for r in received)
        return {
            "weights_bytes": float(nbytes),
            "weights_seconds": seconds,
            "weights_gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else 0.0,
            "weights_lag_steps": max(r.metrics()["lag_steps"] for r in received),
        }

    def wait_for_weights(self, min_step: int, *, timeout: float = 600.0) -> bool:
        """Block until weights of at least ``min_step`` arrive (or stop/timeout)."""
        deadline = time.monotonic() + timeout
        while self.weight_step < min_step and not self._stop.is_set():
            if not self.sync_weights():
                if time.monotonic() > deadline:
                    return False
                self._stop.wait(0.05)
        return self.weight_step >= min_step

    def warm_up(self) -> float:
        """Compile what the first batch needs (a training batch of the first lesson) before the
        trainer is ready, on throw-away problems: nothing is written, logged or told to the
        curriculum. Returns the seconds it took; a failure here only logs a warning (the real
        batch will meet it again), and env calls are cut off early
        (:data:`~marin_rl_core.rollout.manager.WARM_UP_STEP_TIMEOUT_S`), so a hung env does not
        hold up the worker's set-up. The held-out eval is not warmed up: worker 0 runs it after
        writing the batch of its step, while the trainer compiles and takes its first step.

        Not with levanter's paged engine, which compiles its fixed shapes on first use: the
        others' compiled shapes follow the batch."""
        if self.manager.engine_name == "paged":
            return 0.0
        start = time.monotonic()
        manager, config = self.manager, self.config
        first = next(iter(manager.lessons))
        try:
            sampling = config.sampling_for(manager.lessons[first])
            batch, _ = manager.sample_batch(
                first,
                n_examples=sampling.n_prompts,
                n_generations=sampling.n_generations_per_prompt,
                mode="train",
                seed=self._seed(self.next_batch) ^ 0x5EED,
                weight_step=0,
                worker_id=self.worker_id,
                warm_up=True,
            )
            if batch is not None and batch.rollouts:
                self.warm_up_tokens = max(r.num_tokens for r in batch.rollouts)
        except Exception as exc:  # noqa: BLE001 - warming up is an optimisation only
            logger.warning("warming up the sampler failed (%s: %s)", type(exc).__name__, exc)
        seconds = time.monotonic() - start
        logger.info("worker %s: sampler warmed up in %.1f s", self.worker_id, seconds)
        return seconds

    # --- the loop -----------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop :meth:`run` (thread-safe): the batch being sampled is cancelled, not waited
        for, and is not counted (a resumed run samples it again)."""
        self._stop.set()
        manager = getattr(self, "manager", None)
        if manager is not None:
            manager.cancel()

    def _seed(self, counter: int) -> int:
        return batch_seed(self.config.seed, self.worker_index, counter, salt=self.seed_salt)

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
        from marin_rl_core.sample_rows import sample_row

        keep = max(self.config.logging.samples_per_step, 0)
        rows = [
            {**sample_row(r, self.manager.tokenizer, step=step), "source": "eval"}
            for _, batch in results.values()
            for r in (batch.rollouts if batch is not None else [])[:keep]
        ]
        if rows:
            self._samples(rows)
        metrics: dict[str, Any] = {}
        for lesson_id, (stats, _) in results.items():
            metrics[f"eval/{lesson_id}/n"] = stats.n_rollouts
            if not stats.n_rollouts:
                continue  # nothing scored: no reward (a 0.0 here would be a made-up score)
            metrics[f"eval/{lesson_id}/reward"] = stats.mean_reward
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
        """Write ``batch``, blocking while storage is full; ``False`` if stopped first.

        A storage error is retried with backoff (0.5 s doubling to 30 s), the same batch each
        time (storage delivers it once), counted in ``rollout/write_errors`` and logged at most
        once a minute; nothing is dropped. A storage that keeps failing stops the job through
        the watchdog, whose report shows these counts."""
        backoff = 0.5
        while not self._stop.is_set():
            try:
                self.writer.write_batch(batch, timeout=1.0)
                return True
            except TimeoutError:
                continue  # storage is full: the trainer is behind; keep trying until stopped
            except Exception as exc:  # noqa: BLE001 - any storage error is retried
                self.write_errors += 1
                now = time.monotonic()
                if now - self._write_error_logged > 60:
                    self._write_error_logged = now
                    logger.warning(
                        "writing rollouts to storage failed (%d errors so far), retrying in "
                        "%.1f s: %s: %s",
                        self.write_errors,
                        backoff,
                        type(exc).__name__,
                        exc,
                    )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
        return False

    def run(self, *, max_batches: int | None = None) -> dict[str, int]:
        """Generate and ship rollout batches until stopped; returns counters."""
        from marin_rl_core.rollout.episode_state import BatchCancelled

        try:
            return self._run(max_batches)
        except BatchCancelled:
            if not self._stop.is_set():
                raise
            logger.info("worker %s: stopped; the batch being sampled was cancelled", self.worker_id)
            return self.counters()

    def _run(self, max_batches: int | None) -> dict[str, int]:
        self.wait_for_weights(0)
        counter = self.next_batch
        eval_every = self.config.eval.frequency
        end = None if max_batches is None else counter + max_batches
        while not self._stop.is_set() and (end is None or counter < end):
            paced_seconds = self.pacer.wait(lambda: self.weight_step, self.sync_weights, self._stop)
            if self._stop.is_set():
                break
            sync_start = time.monotonic()
            synced = self.sync_weights()
            sync_seconds = time.monotonic() - sync_start
            if end is None and self.weight_step >= self.config.trainer.num_train_steps > 0:
                # The final step's weights: training is over, and a batch sampled now would be
                # trained by nobody (in an agent env, a process an episode). The driver stops
                # this worker (it watches the job) and asks worker 0 for the final eval.
                logger.info("worker %s: training is done; no more batches", self.worker_id)
                while not self._stop.wait(1.0):
                    pass
                break
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
            batch_step = self.weight_step
            with self._in_flight() as swaps:
                batch, metrics = self.manager.sample_batch(
                    lesson_id,
                    n_examples=sampling.n_prompts,
                    n_generations=sampling.n_generations_per_prompt,
                    mode="train",
                    seed=self._seed(counter),
                    weight_step=batch_step,
                    worker_id=self.worker_id,
                    worker_index=self.worker_index,
                    batch_index=counter,
                )
            metrics["in_flight_swaps"] = float(swaps[0])
            counter += 1
            self.next_batch = counter
            self.batches_sampled += 1
            self.prompts_too_long += int(metrics.get("prompts_too_long", 0))
            self.env_errors += int(metrics.get("env_errors", 0))
            self.env_timeouts += int(metrics.get("env_timeouts", 0))
            write_seconds = 0.0
            if batch is None:
                # Every problem was dropped (prompts too long, env errors): retrying at full
                # speed would only burn CPU and flood the metrics. Back off, 0.05 s doubling to
                # 5 s; the watchdog names the cause if this goes on.
                self.empty_batches_in_a_row += 1
                self._stop.wait(min(0.05 * 2 ** min(self.empty_batches_in_a_row - 1, 7), 5.0))
            else:
                self.empty_batches_in_a_row = 0
                self.pacer.count_generated(len(batch.rollouts), batch_step)
                self.manager.update_training_stats(lesson_id, batch, self.weight_step)
                write_start = time.monotonic()
                if self._write(batch):
                    self.batches_written += 1
                    self.pacer.written_through = counter
                write_seconds = time.monotonic() - write_start
            # Where the worker's time goes: generating and scoring (``seconds``), pulling
            # weights, writing (blocked while storage is full: the trainer is behind), and
            # waiting for newer weights when it is as far ahead as pacing allows.
            metrics["weight_sync_seconds"] = sync_seconds if synced else 0.0
            metrics.update(self._receive_metrics())
            metrics["weight_errors"] = self.weight_errors
            metrics["paced_seconds"] = paced_seconds
            metrics["rollouts"] = float(len(batch.rollouts)) if batch is not None else 0.0
            metrics["write_seconds"] = write_seconds
            metrics["write_errors"] = self.write_errors
            metrics.update(device_memory())  # on accelerators: in use now, and the peak
            metrics = {f"rollout/{k}": v for k, v in metrics.items()}
            metrics["rollout/lesson"] = lesson_id
            metrics["rollout/worker"] = self.worker_index
            metrics["rollout/batch_index"] = counter - 1
            metrics["rollout/weight_syncs"] = self.weight_syncs
            self._log(metrics, step=max(self.weight_step, 0), source="rollout")
            # Worker 0's held-out eval, after the batch is on its way and its row logged: the
            # trainer trains on it meanwhile (the step-0 eval overlaps the first steps instead
            # of delaying them), and a job whose trainer finishes during the eval still has the
            # batch's row in its metrics.
            if self.worker_index == 0 and self.weight_step >= self._next_eval:
                self.evaluate()
                self._next_eval = (
                    (self.weight_step // eval_every + 1) * eval_every if eval_every else 1 << 62
                )
        return self.counters()

    def counters(self) -> dict[str, Any]:
        """Totals since the worker started (the watchdog's report uses them)."""
        return {
            "batches_sampled": self.batches_sampled,
            "batches_written": self.batches_written,
            "recent_empty_batches": self.empty_batches_in_a_row,
            "prompts_too_long": self.prompts_too_long,
            "env_errors": self.env_errors,
            "env_timeouts": self.env_timeouts,
            "last_env_error": getattr(getattr(self, "manager", None), "last_env_error", None) or "",
            "write_errors": self.write_errors,
            "weight_syncs": self.weight_syncs,
            "weight_step": self.weight_step,
            "weight_errors": self.weight_errors,
            "last_weight_error": self.last_weight_error,
        }

    def final_eval(self, final_step: int, *, timeout: float = 600.0) -> dict[str, float]:
        """After training: wait for the final weights, then evaluate every lesson.

        Raises:
            MarinRLError: the weights of ``final_step`` did not come within ``timeout``
                seconds (an eval of older weights would be logged as the final one).
        """
        self._stop.clear()
        if not self.wait_for_weights(final_step, timeout=timeout):
            raise MarinRLError(
                f"rollout worker {self.worker_index} did not receive the weights of step "
                f"{final_step} within {timeout:.0f} s (it has step {self.weight_step})"
            )
        return self.evaluate()
