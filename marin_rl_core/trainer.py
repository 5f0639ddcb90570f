"""The learner: replay buffer in, optimizer steps, weights and checkpoints out.

:class:`Trainer` builds the policy (the same initial weights every rollout worker builds from
the run's seed), the loss plugin, an optax AdamW optimizer and one jitted train step made from
the loss plugin's ``create_loss_fn``. A frozen copy of the initial policy is kept as the
reference model only when the loss asks for one.

Each step waits until the replay buffer can hand out ``trainer.batch_size`` rollouts, trains on
them, advances the buffer's notion of "current step" (which drops stale rollouts), publishes
weights every ``sync_interval_steps`` and checkpoints every ``checkpoint_interval_steps``.

Faults: a non-finite loss stops training with :class:`TrainingDivergedError` *before* the bad
update is checkpointed, so the last good checkpoint stays the newest. :meth:`Trainer.request_stop`
(Ctrl-C in the driver) makes :meth:`Trainer.run` save a checkpoint at the current step and return;
a later run with the same run directory resumes from it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from marin_rl_core.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from marin_rl_core.config import RLJobConfig, TrainerConfig
from marin_rl_core.errors import MarinRLError
from marin_rl_core.protocols import RolloutReader, WeightTransferServer
from marin_rl_core.registry import Registry
from marin_rl_core.types import Rollout

logger = logging.getLogger(__name__)


class TrainingDivergedError(MarinRLError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


def initial_model(config: RLJobConfig, tokenizer: Any) -> Any:
    """The run's initial policy; every process that calls this gets identical weights."""
    import jax

    from marin_rl_core.model import build_model

    return build_model(config.model, tokenizer, key=jax.random.PRNGKey(config.seed))


def make_schedule(t: TrainerConfig) -> Any:
    """The learning rate against the optimizer step: linear warmup to ``learning_rate``, then
    ``lr_schedule`` down to ``min_lr_ratio * learning_rate`` at ``num_train_steps``."""
    import optax

    peak, warmup = t.learning_rate, max(t.warmup_steps, 0)
    end = peak * (1.0 if t.lr_schedule == "constant" else t.min_lr_ratio)
    decay_steps = max(t.num_train_steps - warmup, 1)
    if t.lr_schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=t.min_lr_ratio)
    else:  # linear, or constant (end == peak)
        decay = optax.linear_schedule(peak, end, decay_steps)
    if warmup == 0:
        return decay
    return optax.join_schedules(
        [optax.linear_schedule(peak / warmup, peak, warmup), decay], boundaries=[warmup]
    )


def make_optimizer(t: TrainerConfig) -> Any:
    """AdamW on :func:`make_schedule`, after global-norm clipping (if ``max_grad_norm > 0``)."""
    import optax

    parts = []
    if t.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(t.max_grad_norm))
    parts.append(optax.adamw(make_schedule(t), b1=0.9, b2=0.99, weight_decay=t.weight_decay))
    return optax.chain(*parts)


def make_train_step(loss_fn: Callable[..., Any], optimizer: Any) -> Callable[..., Any]:
    """One jitted optimizer step. The model and optimizer state are donated: the caller keeps
    only what the step returns."""
    import equinox as eqx
    import optax

    @eqx.filter_jit(donate="all-except-first")
    def train_step(batch: Any, model: Any, opt_state: Any, key: Any) -> Any:
        def objective(m: Any) -> Any:
            return loss_fn(m, batch, key=key)

        (loss, metrics), grads = eqx.filter_value_and_grad(objective, has_aux=True)(model)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        model = eqx.apply_updates(model, updates)
        metrics = dict(metrics)
        metrics["grad_norm"] = optax.global_norm(grads)
        return model, opt_state, loss, metrics

    return train_step


def zero_variance_fraction(rollouts: list[Rollout]) -> float:
    """Fraction of groups (samples of one problem from one batch) whose rewards are all equal:
    they carry no RLOO gradient. A rising value warns of a policy going deterministic."""
    groups: dict[tuple[Any, ...], list[float]] = {}
    for r in rollouts:
        meta = r.metadata
        key = (
            r.lesson_id,
            r.problem_id,
            meta.worker_id if meta else "",
            meta.timestamp if meta else 0,
        )
        groups.setdefault(key, []).append(r.reward)
    sized = [g for g in groups.values() if len(g) > 1]
    if not sized:
        return 0.0
    return float(np.mean([max(g) == min(g) for g in sized]))


class Trainer:
    """See the module docstring.

    Args:
        config: the resolved run config.
        registry: the loaded plugins (the loss is built from it).
        run_dir: where checkpoints go and are resumed from.
        reader: rollout storage's reader end.
        weight_server: publishes weights to rollout workers; ``None`` trains without syncing.
        log: ``log(metrics, step=..., source="train")``, e.g. a :class:`MetricsHub` method.
        curriculum_state: returns the curriculum's state to save beside checkpoints.
    """

    def __init__(
        self,
        config: RLJobConfig,
        registry: Registry,
        *,
        run_dir: str | Path,
        reader: RolloutReader,
        weight_server: WeightTransferServer | None = None,
        log: Callable[..., Any] | None = None,
        curriculum_state: Callable[[], dict[str, Any]] | None = None,
    ):
        import equinox as eqx
        import jax

        from marin_rl_core.replay_buffer import ReplayBuffer
        from marin_rl_core.tokenizer import model_tokenizer

        self.config = config
        self._temperature = {
            lesson.id: config.sampling_for(lesson).temperature for lesson in config.curriculum.lessons
        }
        self.run_dir = Path(run_dir)
        self.reader = reader
        self.weight_server = weight_server
        self._log = log or (lambda metrics, *, step, source: None)
        self._curriculum_state = curriculum_state or dict
        self._stop = threading.Event()
        self.tokenizer = model_tokenizer(config.model)

        model = initial_model(config, self.tokenizer)
        loss = registry.get("loss", config.loss.name).build(config.loss.config)
        reference = None
        if loss.needs_reference_model:
            # A real copy: the train step donates the policy's buffers.
            reference = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, model)
        self.loss = loss.build(reference)
        self.optimizer = make_optimizer(config.trainer)
        self._schedule = make_schedule(config.trainer)
        opt_state = self.optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        self.step = 0
        self.resumed_state: dict[str, Any] = {}
        checkpoint = latest_checkpoint(self.run_dir)
        if checkpoint is not None:
            model, opt_state, state = load_checkpoint(
                checkpoint, model_like=model, opt_state_like=opt_state
            )
            self.step = int(state["step"])
            self.resumed_state = state
            logger.info("resumed from %s at step %d", checkpoint, self.step)
        self.model, self.opt_state = model, opt_state
        self.replay = ReplayBuffer(config.replay_buffer, self.loss, seed=config.seed)
        self.replay.set_current_step(self.step)
        self._train_step = make_train_step(
            self.loss.create_loss_fn(reference, model), self.optimizer
        )
        self._key = jax.random.PRNGKey(config.seed + 1)
        self.last_checkpoint_step: int | None = self.step if checkpoint is not None else None
        self._published_step: int | None = None

    # --- control ------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask :meth:`run` to checkpoint and return at the next opportunity (thread-safe)."""
        self._stop.set()

    def publish(self) -> None:
        """Send the current weights to rollout workers (once per step at most)."""
        if self.weight_server is not None and self._published_step != self.step:
            self.weight_server.publish(self.model, weight_step=self.step)
            self._published_step = self.step

    def checkpoint(self) -> Path:
        path = save_checkpoint(
            self.run_dir,
            self.step,
            model=self.model,
            opt_state=self.opt_state,
            state={"curriculum": self._curriculum_state()},
        )
        self.last_checkpoint_step = self.step
        return path

    # --- the loop -----------------------------------------------------------------------------

    def _wait_for_batch(self) -> tuple[list[Rollout], np.ndarray, float] | None:
        """Read rollouts until the buffer can fill a batch; ``None`` if asked to stop."""
        start = time.perf_counter()
        size = self.config.trainer.batch_size
        while not self._stop.is_set():
            sampled = self.replay.sample(size)
            if sampled is not None:
                rollouts, advantages = sampled
                return (
                    list(rollouts),
                    np.asarray(advantages, dtype=np.float32),
                    time.perf_counter() - start,
                )
            batches = self.reader.read_batches(max_batches=64, timeout=0.5)
            if batches:
                self.replay.add_batches(batches, current_step=self.step)
        return None

    def train_one_step(self, rollouts: list[Rollout], advantages: np.ndarray) -> dict[str, float]:
        """One optimizer step on ``rollouts``; returns its metrics (host floats)."""
        import jax

        from marin_rl_core.training_batch import training_batch_from_rollouts

        # Behaviour logprobs are of the tempered distribution; the loss tempers each row alike.
        temperature = [self._temperature[r.lesson_id] for r in rollouts]
        batch = training_batch_from_rollouts(
            rollouts,
            advantages,
            self.config.model.max_seq_len,
            self.tokenizer.pad_id,
            temperature=temperature,
            batch_size=self.config.trainer.batch_size,
        )
        self._key, key = jax.random.split(self._key)
        start = time.perf_counter()
        model, opt_state, loss, metrics = self._train_step(batch, self.model, self.opt_state, key)
        loss = float(loss)
        seconds = time.perf_counter() - start
        out = {k: float(np.asarray(v)) for k, v in metrics.items()}
        out["loss"] = loss
        out["step_seconds"] = seconds
        bad = [k for k in ("loss", "grad_norm") if k in out and not math.isfinite(out[k])]
        if bad:
            raise TrainingDivergedError(
                f"training diverged at step {self.step + 1}: non-finite {', '.join(bad)}. "
                f"The last good checkpoint (step {self.last_checkpoint_step}) is kept in "
                f"{self.run_dir / 'checkpoints'}; lower trainer.learning_rate or raise "
                "trainer.max_grad_norm's strictness and resume from it."
            )
        self.model, self.opt_state = model, opt_state
        self.step += 1
        return out

    def _write_samples(self, rollouts: list[Rollout]) -> None:
        """Append a few trained-on rollouts, decoded, to ``samples.jsonl``."""
        n = self.config.logging.samples_per_step
        if n <= 0:
            return
        import json

        with (self.run_dir / "samples.jsonl").open("a") as f:
            for r in rollouts[:n]:
                meta = r.metadata
                f.write(
                    json.dumps(
                        {
                            "step": self.step,
                            "lesson": r.lesson_id,
                            "problem": r.problem_id,
                            "prompt": self.tokenizer.decode(r.prompt_tokens.tolist()),
                            "response": self.tokenizer.decode(r.response_tokens.tolist()),
                            "reward": r.reward,
                            "truncated": r.truncated,
                            "worker_id": meta.worker_id if meta else None,
                            "weight_step": meta.weight_step if meta else None,
                            "timestamp": meta.timestamp if meta else None,
                        }
                    )
                    + "\n"
                )

    def run(self) -> int:
        """Train until ``num_train_steps`` or a stop request; returns the step reached.

        A checkpoint is written at the end either way; weights of the final step are published.
        """
        total = self.config.trainer.num_train_steps
        t = self.config.trainer
        self.publish()
        while self.step < total:
            got = self._wait_for_batch()
            if got is None:
                break
            rollouts, advantages, waited = got
            metrics = self.train_one_step(rollouts, advantages)
            self.replay.set_current_step(self.step)
            metrics.update(
                learning_rate=float(self._schedule(self.step - 1)),
                reward=float(np.mean([r.reward for r in rollouts])),
                frac_zero_variance_groups=zero_variance_fraction(rollouts),
                wait_seconds=waited,
                mean_weight_lag=float(
                    np.mean(
                        [self.step - 1 - r.metadata.weight_step for r in rollouts if r.metadata]
                    )
                ),
            )
            metrics.update({f"replay/{k}": v for k, v in self.replay.metrics().items()})
            if self.step % t.sync_interval_steps == 0 or self.step == total:
                self.publish()
            if self.step % t.checkpoint_interval_steps == 0 or self.step == total:
                self.checkpoint()
            if self.step % self.config.logging.log_every == 0 or self.step == total:
                self._log(metrics, step=self.step, source="train")
            self._write_samples(rollouts)
        if self.last_checkpoint_step != self.step:
            self.checkpoint()
        self.publish()
        return self.step
