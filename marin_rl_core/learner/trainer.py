"""The learner: replay buffer in, optimizer steps, weights and checkpoints out.

:class:`Trainer` builds the policy (the same initial weights every rollout worker builds from
the run's seed), the loss plugin and a :class:`Learner`: levanter's trainer machinery (device
mesh, sharded parameters and optimizer state, mixed precision, gradient accumulation, TensorStore
checkpoints) around an optax AdamW optimizer and the loss plugin's ``create_loss_fn``. A frozen
copy of the initial policy is kept as the reference model only when the loss asks for one.

The train step itself is :class:`~marin_rl_core.learner.step.Learner`'s.

Each step waits until the replay buffer can hand out ``trainer.batch_size`` rollouts, trains on
them, advances the buffer's notion of "current step" (which drops stale rollouts), publishes
weights every ``sync_interval_steps`` and checkpoints every ``checkpoint_interval_steps``.

Faults: a non-finite loss or gradient norm stops training with :class:`TrainingDivergedError`
before the update is kept, and parameters that are no longer finite are never checkpointed, so
the last good checkpoint stays the newest. :meth:`Trainer.request_stop`
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

from marin_rl_core.config.schema import RLJobConfig
from marin_rl_core.errors import MarinRLError
from marin_rl_core.learner.checkpoint import (
    checkpoints_newest_first,
    load_newest,
    read_state,
    save_checkpoint,
)
from marin_rl_core.learner.loss import batch_options, policy_of, with_loss_state
from marin_rl_core.learner.step import Learner, all_finite, make_schedule, plugin_loss_fn
from marin_rl_core.metrics import drop_rows_after
from marin_rl_core.models.build import initial_model
from marin_rl_core.protocols import RolloutReader, WeightTransferServer
from marin_rl_core.registry import Registry
from marin_rl_core.types import Rollout

logger = logging.getLogger(__name__)
STAGE_KEYS = ("wait_seconds", "step_seconds", "publish_seconds", "checkpoint_seconds")
"""The trainer's stages in its ``train`` rows: mean seconds per step since the last row."""
REPLAY_FILE = "replay_buffer.arrow"
"""The replay buffer's rollouts in a checkpoint (Arrow IPC; the rest is in ``state.json``)."""


class TrainingDivergedError(MarinRLError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


def _timed(fn: Callable[[], Any]) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def sample_turns(rollout: Rollout, tokenizer: Any) -> list[dict[str, Any]]:
    """Each turn of ``rollout`` decoded, as ``samples.jsonl`` shows it: the policy's
    ``action``, the env's ``observation`` after it (empty after the last turn) and the turn's
    ``reward``."""
    turns = []
    for (start, end), reward in zip(rollout.turn_spans(), rollout.turn_rewards.tolist()):
        mask = rollout.loss_mask[start:end]
        # An action is the run of sampled tokens the turn starts with; the rest is observation.
        unsampled = np.flatnonzero(~mask)
        split = start + (int(unsampled[0]) if unsampled.size else end - start)
        turns.append(
            {
                "action": tokenizer.decode(rollout.tokens[start:split].tolist()),
                "observation": tokenizer.decode(rollout.tokens[split:end].tolist()),
                "reward": reward,
            }
        )
    return turns


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

        from marin_rl_core.learner.replay_buffer import ReplayBuffer
        from marin_rl_core.models.tokenizer import model_tokenizer

        self.config = config
        self._temperature = {
            lesson.id: config.sampling_for(lesson).temperature
            for lesson in config.curriculum.lessons
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
        self.learner = Learner(
            config.trainer, hf_checkpoint=bool(config.model.checkpoint), run_id=self.run_dir.name
        )
        reference = None
        if loss.needs_reference_model:
            # A frozen copy of the initial policy in compute precision, sharded like the policy
            # (a real copy: the train step donates the policy's buffers).
            reference = self.learner.shard(
                self.learner.mp.cast_to_compute(
                    jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, model)
                )
            )
        self.loss = loss.build(reference)
        # A critic (or other trainable loss state) is trained, sharded and checkpointed with
        # the policy; never published or exported.
        model, state_lr = with_loss_state(
            self.loss, model, key=jax.random.PRNGKey(config.seed + 2),
            learning_rate=config.trainer.learning_rate,
        )  # fmt: skip
        self.learner.set_loss(
            plugin_loss_fn(self.loss), reference=reference, state_learning_rate=state_lr
        )
        self._schedule = make_schedule(config.trainer)
        key = jax.random.PRNGKey(config.seed + 1)
        if checkpoints_newest_first(self.run_dir):
            # Resuming: the checkpoint is read into the state's shapes, so that one trainer state
            # is alive, not a fresh one beside the restored one (and the base model is gone).
            like = self.learner.state_shapes(model, key=key)
        else:
            like = self.learner.init_state(model, key=key)
        del model
        self.state = like
        self.step = 0
        self.resumed_state: dict[str, Any] = {}
        self.resume_warnings: list[str] = []
        self.replay = ReplayBuffer(config.replay_buffer, self.loss, seed=config.seed)
        self.rollout_positions: dict[int, int] = {}
        """Per rollout worker, the counter after the newest batch read from storage."""
        found = load_newest(self.run_dir, lambda path: self._restore(path, like=like))
        checkpoint = None
        if found is not None:
            checkpoint, (self.resumed_state, self.state), self.resume_warnings = found
            self.step = int(self.resumed_state["step"])
            self.rollout_positions = {
                int(k): int(v) for k, v in self.resumed_state.get("rollout_positions", {}).items()
            }
            for warning in self.resume_warnings:
                logger.warning("%s", warning)
            logger.info(
                "resumed from %s at step %d: %d rollouts back in the replay buffer, rollout "
                "workers go on from batches %s",
                checkpoint,
                self.step,
                len(self.replay),
                self.rollout_positions or "0",
            )
        logger.info(
            "trainer mesh: %s over %d device(s) (%s), precision %s",
            self.learner.sizes,
            jax.device_count(),
            jax.devices()[0].platform,
            self.learner.mp,
        )
        # Samples of steps after the checkpoint (written by a run that died) give way to the
        # steps trained again, as their metric rows do.
        drop_rows_after(self.run_dir / "samples.jsonl", self.step)
        self.replay.set_current_step(self.step)
        self.last_checkpoint_step: int | None = self.step if checkpoint is not None else None
        self._published_step: int | None = None
        self.rollouts_read = 0
        self._stage, self._stage_since = "starting", time.monotonic()
        self._last_read = self._stage_since  # when rollouts last arrived

    def _restore(self, path: Path, *, like: Any) -> tuple[dict[str, Any], Any]:
        """Read checkpoint ``path``: its state, the replay buffer it held, the trainer state."""
        state = read_state(path)
        replay = path / REPLAY_FILE
        if replay.exists():  # checkpoints of older versions have none: an empty buffer
            self.replay.load_state_dict(replay.read_bytes(), state["replay_buffer"])
        return state, self.learner.restore(path, like)

    def _enter(self, stage: str) -> float:
        """Mark the stage the trainer is in (the watchdog reports it); returns the time."""
        self._stage, self._stage_since = stage, time.monotonic()
        return self._stage_since

    def starved_seconds(self) -> float:
        """How long the trainer has been waiting for rollouts without any arriving (0 while it
        trains, publishes or checkpoints). Paced rollout workers ask (thread-safe): a trainer
        short of rollouts (some dropped, filtered or evicted) gets more without waiting for
        newer weights that cannot come."""
        if self._stage != "waiting for rollouts":
            return 0.0
        return time.monotonic() - max(self._stage_since, self._last_read)

    def pacing_feedback(self, worker_id: str) -> tuple[float, int]:
        """What a paced rollout worker asks before it waits for newer weights (thread-safe):
        :meth:`starved_seconds`, and how many of its rollouts were dropped unused
        (:meth:`~marin_rl_core.learner.replay_buffer.ReplayBuffer.unused_dropped`), which it
        generates again instead of falling a step behind for the rest of the run."""
        return self.starved_seconds(), self.replay.unused_dropped(worker_id)

    def diagnostics(self) -> dict[str, Any]:
        """What the watchdog reports when no step completes (thread-safe reads)."""
        replay = self.replay.metrics(reset=False)
        return {
            "step": self.step,
            "stage": self._stage,
            "stage_seconds": time.monotonic() - self._stage_since,
            "rollouts_read": self.rollouts_read,
            "rollouts_in_buffer": int(replay.get("rollouts_in_buffer", 0)),
            "dropped_stale": int(
                replay.get("dropped_stale_step", 0) + replay.get("dropped_stale_time", 0)
            ),
            "dropped_by_loss": int(replay.get("dropped_by_loss", 0)),
        }

    @property
    def model(self) -> Any:
        """The current policy (parameters in the precision policy's parameter dtype)."""
        return policy_of(self.state.model)

    # --- control ------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask :meth:`run` to checkpoint and return at the next opportunity (thread-safe)."""
        self._stop.set()

    def publish(self) -> None:
        """Send the current weights to rollout workers (once per step at most)."""
        if self.weight_server is not None and self._published_step != self.step:
            # In the rollout engines' dtype: what they sample with, and half the bytes for bf16.
            from marin_rl_core.models.build import cast_floating

            self._enter("publishing weights")
            self.weight_server.publish(
                cast_floating(self.model, self.config.model.resolved_inference_dtype),
                weight_step=self.step,
            )
            self._published_step = self.step

    def _kept(self) -> str:
        if self.last_checkpoint_step is None:
            return "No checkpoint had been written yet: start the run again"
        return (
            f"The last good checkpoint (step {self.last_checkpoint_step}) is kept in "
            f"{self.run_dir / 'checkpoints'}: resume from it with `marinrl run --resume "
            f"{self.run_dir.absolute()} --set ...`"
        )

    def checkpoint(self) -> Path:
        """Write a checkpoint of the current state, refusing parameters that are not finite.

        Raises:
            TrainingDivergedError: a parameter is NaN or infinite (the update of a step whose
                loss was still finite can do that): the last good checkpoint stays the newest.
        """
        self._enter("writing a checkpoint")
        if not all_finite(self.state.model):
            raise TrainingDivergedError(
                f"training diverged at step {self.step}: the parameters are no longer finite. "
                f"{self._kept()}; lower trainer.learning_rate or trainer.max_grad_norm."
            )
        replay_data, replay_state = self.replay.state_dict()
        path = save_checkpoint(
            self.run_dir,
            self.step,
            trainer_state=self.state,
            state={
                "curriculum": self._curriculum_state(),
                "replay_buffer": replay_state,
                "rollout_positions": {str(k): v for k, v in self.rollout_positions.items()},
            },
            files={REPLAY_FILE: replay_data},
        )
        self.last_checkpoint_step = self.step
        return path

    # --- the loop -----------------------------------------------------------------------------

    def _wait_for_batch(self) -> tuple[list[Rollout], np.ndarray, float] | None:
        """Read rollouts until the buffer can fill a batch; ``None`` if asked to stop."""
        start = self._enter("waiting for rollouts")
        size = self.config.trainer.batch_size
        while not self._stop.is_set():
            sampled = self.replay.sample(size)
            if sampled is not None:
                rollouts, advantages = sampled
                return (
                    list(rollouts),
                    np.asarray(advantages, dtype=np.float32),
                    time.monotonic() - start,
                )
            batches = self.reader.read_batches(max_batches=64, timeout=0.5)
            if batches:
                self._last_read = time.monotonic()
                self.rollouts_read += sum(len(b.rollouts) for b in batches)
                for rollout in (r for b in batches for r in b.rollouts):
                    meta = rollout.metadata
                    if meta is not None and meta.worker_index is not None:
                        after = (meta.batch_index or 0) + 1
                        if after > self.rollout_positions.get(meta.worker_index, 0):
                            self.rollout_positions[meta.worker_index] = after
                self.replay.add_batches(batches, current_step=self.step)
        return None

    @property
    def _row_multiple(self) -> int:
        """Packed batches have a multiple of this many rows (or ``batch_size`` rows, which
        :func:`~marin_rl_core.learner.training_batch.training_batch_from_rollouts` never exceeds): an
        eighth of the batch (so at most nine shapes compile), and whole micro-batches and
        data-parallel shards."""
        t = self.config.trainer
        unit = t.microbatch_size or self.learner.sizes["batch_shards"]
        return math.lcm(max(1, t.batch_size // 8), unit)

    def _training_batch(self, rollouts: list[Rollout], advantages: np.ndarray) -> Any:
        from marin_rl_core.learner.training_batch import training_batch_from_rollouts

        # Behaviour logprobs are of the tempered distribution; the loss tempers each row alike.
        temperature = [self._temperature[r.lesson_id] for r in rollouts]
        return training_batch_from_rollouts(
            rollouts,
            advantages,
            self.config.model.max_seq_len,
            self.tokenizer.pad_id,
            temperature=temperature,
            batch_size=self.config.trainer.batch_size,
            pack=self.config.trainer.pack_rollouts,
            row_multiple=self._row_multiple,
            trim=self.config.trainer.trim_rows,
            **batch_options(self.loss),
        )

    def _start_warm_up(self) -> threading.Thread | None:
        """Trace the train step in the background while the first rollouts are generated: the
        first step otherwise spends ~1 s of a 2-core machine tracing and lowering it after
        they arrive (issue 11). The shapes are those of a batch whose rollouts all fit the
        shortest trimmed row (8 tokens: short answers, as the default task has) or, with
        ``trim_rows`` off, of every batch; packed batches vary in rows, so they get none. A
        first batch of other shapes traces its own step as before: what the warm-up made goes
        unused, and no XLA compile is wasted on it (see :meth:`Learner.warm_up`)."""
        if self.config.trainer.pack_rollouts:
            return None
        batch = self._training_batch([], np.zeros(0, np.float32))
        state = self.state

        def warm_up() -> None:
            start = time.monotonic()
            try:
                self.learner.warm_up(state, batch)
            except Exception:  # the first real step reports what is wrong, with its batch
                logger.debug("train step warm-up failed", exc_info=True)
                return
            logger.info(
                "train step traced in %.1f s for batches of %s rows x %s positions",
                time.monotonic() - start,
                batch.Batch.size,
                batch.Pos.size,
            )

        thread = threading.Thread(target=warm_up, name="marinrl-step-warm-up", daemon=True)
        thread.start()
        return thread

    def train_one_step(self, rollouts: list[Rollout], advantages: np.ndarray) -> dict[str, float]:
        """One optimizer step on ``rollouts``; returns its metrics (host floats)."""
        batch = self._training_batch(rollouts, advantages)
        start = self._enter("in a training step")
        state, loss, out = self.learner.step(self.state, batch)
        seconds = time.monotonic() - start
        out["loss"] = loss
        out["step_seconds"] = seconds
        bad = [k for k in ("loss", "grad_norm") if k in out and not math.isfinite(out[k])]
        if bad:
            raise TrainingDivergedError(
                f"training diverged at step {self.step + 1}: non-finite {', '.join(bad)}. "
                f"{self._kept()}; lower trainer.learning_rate or trainer.max_grad_norm."
            )
        self.state = state
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
                            "turns": sample_turns(r, self.tokenizer),
                            "part": r.part,
                            "reward": r.reward,
                            "truncated": r.truncated,
                            "worker_id": meta.worker_id if meta else None,
                            "worker": meta.worker_index if meta else None,
                            "batch": meta.batch_index if meta else None,
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
        warm_up = self._start_warm_up() if self.step < total else None
        # Seconds per stage, summed over the steps since the last logged row: each row holds
        # their means per step, so rows average to the true split whatever log_every is.
        stages: dict[str, float] = dict.fromkeys(STAGE_KEYS, 0.0)
        steps_since_log = 0
        while self.step < total:
            got = self._wait_for_batch()
            if got is None:
                break
            rollouts, advantages, waited = got
            if warm_up is not None:  # never trace the same step twice at once
                warm_up.join()
                warm_up = None
            metrics = self.train_one_step(rollouts, advantages)
            self.replay.set_current_step(self.step)
            metrics.update(
                learning_rate=float(self._schedule(self.step - 1)),
                reward=float(np.mean([r.reward for r in rollouts])),
                frac_zero_variance_groups=zero_variance_fraction(rollouts),
                mean_weight_lag=float(
                    np.mean(
                        [self.step - 1 - r.metadata.weight_step for r in rollouts if r.metadata]
                    )
                ),
            )
            metrics.update({f"replay/{k}": v for k, v in self.replay.metrics().items()})
            stages["wait_seconds"] += waited
            stages["step_seconds"] += metrics["step_seconds"]
            if self.step % t.sync_interval_steps == 0 or self.step == total:
                stages["publish_seconds"] += _timed(self.publish)
            steps_since_log += 1
            # The step's row and samples are written before its checkpoint: a trainer killed
            # right after a checkpoint must not leave the resumed run without them (rows of
            # steps after the checkpoint are dropped on resume). The checkpoint's seconds go to
            # the next row.
            if self.step % self.config.logging.log_every == 0 or self.step == total:
                metrics.update({k: v / steps_since_log for k, v in stages.items()})
                stages, steps_since_log = dict.fromkeys(STAGE_KEYS, 0.0), 0
                self._log(metrics, step=self.step, source="train")
            self._write_samples(rollouts)
            if self.step % t.checkpoint_interval_steps == 0 or self.step == total:
                stages["checkpoint_seconds"] += _timed(self.checkpoint)
        if self.last_checkpoint_step != self.step:
            self.checkpoint()
        self.publish()
        return self.step
