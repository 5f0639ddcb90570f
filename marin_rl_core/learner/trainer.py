"""The learner: replay buffer in, optimizer steps, weights and checkpoints out.

:class:`Trainer` builds the policy (the same initial weights every rollout worker builds from
the run's seed), the loss plugin and a :class:`Learner`: levanter's trainer machinery (device
mesh, sharded parameters and optimizer state, mixed precision, gradient accumulation, TensorStore
checkpoints) around an optax AdamW optimizer and the loss plugin's ``create_loss_fn``. A frozen
copy of the initial policy is kept as the reference model only when the loss asks for one.

The train step itself is :class:`~marin_rl_core.learner.step.Learner`'s; what a trainer step is
in optimizer updates (its batches, the loss's minibatches and epochs) is
:mod:`~marin_rl_core.learner.step_updates`'s.

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
    has_loss_state,
    load_newest,
    read_state,
    restore_policy_only,
    save_checkpoint,
)
from marin_rl_core.learner.group import CHECKPOINT, PUBLISH, STEP, STOP, GroupChannel
from marin_rl_core.learner.lora_checkpoint import BASE_KEY, base_identity, saved_base
from marin_rl_core.learner.loss import (
    TrainedModel,
    non_finite_advice,
    policy_of,
)
from marin_rl_core.learner.optimizer import make_schedule
from marin_rl_core.learner.samples import rollout_metrics, write_samples
from marin_rl_core.learner.setup import describe_figures, parameter_figures, set_up_training
from marin_rl_core.learner.step import all_finite
from marin_rl_core.learner.step_updates import NonFiniteUpdate, StepUpdates
from marin_rl_core.metrics import device_memory, drop_rows_after
from marin_rl_core.models.lora import adapters_of, merged, sampled_in_place, saved_part
from marin_rl_core.pacing import PacingFeedback
from marin_rl_core.protocols import RolloutReader, RolloutStorage, WeightTransferServer
from marin_rl_core.registry import Registry
from marin_rl_core.rundir import absolute, growing_file, run_path, upload_now
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


class Trainer:
    """See the module docstring.

    Args:
        config: the resolved run config.
        registry: the loaded plugins (the loss is built from it).
        run_dir: where checkpoints go and are resumed from.
        storage: rollout storage (its reader is made here, after the checkpoint restored
            says where to go on from); ``None`` trains only on batches handed in.
        weight_server: publishes weights to rollout workers; ``None`` trains without syncing.
        log: ``log(metrics, step=..., source="train")``, e.g. a :class:`MetricsHub` method.
        curriculum_state: returns the curriculum's state to save beside checkpoints.
        on_checkpoint: called after each checkpoint with its step (the job has the metrics
            hub upload ``metrics.jsonl`` then, for a run directory on a bucket).
        first_rollout_tokens: ``first_rollout_tokens(cancelled)``, the most tokens the first
            rollouts will likely have (the rollout workers' warm-up batch; ``None``: not known),
            waiting until ``cancelled`` is set at most: the step's warm-up traces rows of that
            length (:meth:`StepUpdates.start_warm_up`).
    """

    def __init__(
        self,
        config: RLJobConfig,
        registry: Registry,
        *,
        run_dir: str | Path,
        storage: RolloutStorage | None,
        weight_server: WeightTransferServer | None = None,
        log: Callable[..., Any] | None = None,
        curriculum_state: Callable[[], dict[str, Any]] | None = None,
        on_checkpoint: Callable[[int], None] | None = None,
        first_rollout_tokens: Callable[[threading.Event], int | None] | None = None,
    ):
        import jax

        from marin_rl_core.learner.replay_buffer import ReplayBuffer
        from marin_rl_core.models.tokenizer import model_tokenizer

        self.config = config
        self.run_dir = run_path(run_dir)
        self._samples = growing_file(run_dir, "samples.jsonl")
        self._on_checkpoint = on_checkpoint or (lambda step: None)
        self._first_rollout_tokens = first_rollout_tokens
        self.reader: RolloutReader | None = None
        self.weight_server = weight_server
        self._log = log or (lambda metrics, *, step, source: None)
        self._curriculum_state = curriculum_state or dict
        self._stop = threading.Event()
        self.group = GroupChannel()  # a trainer group: see learner/group.py
        self.tokenizer = model_tokenizer(config.model)

        self.learner, self.loss, model = set_up_training(
            config, registry, self.tokenizer, run_id=self.run_dir.name
        )
        self.lora = config.model.lora.enabled
        self.plan = self.learner.plan
        self._schedule = make_schedule(
            config.trainer,
            updates_per_step=self.plan.updates_per_step,
            frozen_updates=self.plan.frozen_policy_steps * self.plan.updates_per_step,
        )
        # The step's rollouts into batches, and the batches into the loss's updates.
        self.updates = StepUpdates(config, self.plan, self.learner, pad_id=self.tokenizer.pad_id)
        key = jax.random.PRNGKey(config.seed + 1)
        # A LoRA run's checkpoints hold the adapters alone and name their base (lora_checkpoint).
        self._lora_base = base_identity(config) if self.lora else None
        if checkpoints_newest_first(self.run_dir) and not self.lora:
            # Resuming: the checkpoint is read into the state's shapes, so that one trainer state
            # is alive, not a fresh one beside the restored one (and the base model is gone).
            # (A LoRA run's base is not in its checkpoints: it stays, and the adapters are read.)
            like = self.learner.state_shapes(model, key=key)
        else:
            like = self.learner.init_state(model, key=key)
        del model
        self.state = like
        self.step = 0
        self.resumed_state: dict[str, Any] = {}
        self.resume_warnings: list[str] = []
        self.resume_notes: list[str] = []  # what a resume could not restore (_restore)
        self.replay = ReplayBuffer(config.replay_buffer, self.loss, seed=config.seed)
        self.rollout_positions: dict[int, int] = {}
        """Per rollout worker, the counter after the newest batch read from storage."""
        found = load_newest(self.run_dir, lambda path: self._restore(path, like=like))
        checkpoint = None
        if found is not None:
            checkpoint, (self.resumed_state, self.state), self.resume_warnings = found
            self.resume_warnings += self.resume_notes
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
        if storage is not None:
            # Read on after the batches the checkpoint holds (or trained on): exactly once.
            self.reader = storage.reader(self.resumed_state.get("storage_position"))
        logger.info(
            "trainer mesh: %s over %d device(s) (%s), precision %s",
            self.learner.sizes,
            jax.device_count(),
            jax.devices()[0].platform,
            self.learner.mp,
        )
        self._figures = parameter_figures(self.state, self.learner.is_trainable)
        logger.info("%s", describe_figures(self._figures, config.model.lora.rank))
        # Samples of steps after the checkpoint (written by a run that died) give way to the
        # steps trained again, as their metric rows do.
        if self.group.leads:
            drop_rows_after(self._samples, self.step)
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
        adapters_only = saved_base(path) is not None  # a LoRA run's: the base stays as it is
        if has_loss_state(path) != isinstance(like.model, TrainedModel):
            restored, note = restore_policy_only(
                self.learner, self.plan, self.config, path, like, adapters_only=adapters_only
            )  # (a run that switched between rloo and ppo, say)
            self.resume_notes.append(note)
            return state, restored
        only = saved_part(like, self.learner.is_trainable) if adapters_only else None
        return state, self.learner.restore(path, like, only=only)

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

    def pacing_feedback(self, worker_id: str, worker_index: int) -> PacingFeedback:
        """What a paced rollout worker asks before it waits for newer weights (thread-safe;
        :mod:`~marin_rl_core.pacing`): :meth:`starved_seconds`; how many of its rollouts were
        dropped unused (:meth:`~marin_rl_core.learner.replay_buffer.ReplayBuffer.unused_dropped`),
        which it generates again instead of falling a step behind for the rest of the run; how many
        of worker ``worker_index``'s batches were read (a starved trainer with one of them still
        on its way needs nothing more from that worker); the newest weights' step published."""
        published = -1 if self._published_step is None else self._published_step
        dropped = self.replay.unused_dropped(worker_id)
        read = self.rollout_positions.get(worker_index, 0)
        return PacingFeedback(self.starved_seconds(), dropped, read, published)

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
            "storage": self.reader.trouble() if self.reader is not None else "",
        }

    @property
    def model(self) -> Any:
        """The current policy (parameters in the precision policy's parameter dtype); a LoRA
        policy with its adapters (:attr:`merged_model`: with them merged in)."""
        return policy_of(self.state.model)

    def _served(self) -> Any:
        """What :meth:`publish` sends: the policy; a LoRA policy's adapters alone to samplers
        apart (each merges them into the base it holds: a few percent of the bytes), the policy
        unmerged to a colocated sampler (which samples from the trainer's own base)."""
        if self.lora and self.config.resources.colocate is not True:
            return adapters_of(self.model)
        return self.model

    @property
    def merged_model(self) -> Any:
        """The current policy as a plain model (a LoRA policy's adapters merged in: new
        buffers)."""
        with self.learner._context():
            return merged(self.model)

    # --- control ------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask :meth:`run` to checkpoint and return at the next opportunity (thread-safe)."""
        self._stop.set()

    def publish(self) -> None:
        """Hand the current weights to the weight server (once per step at most). The server
        gets a copy of its own, made on the device asynchronously, and serves it in the
        background: the next train step (which donates the state) neither waits for the
        transfer nor can change what is served."""
        serves = self.weight_server is not None or not self.group.leads  # followers gather
        if self._published_step != self.step and serves:
            from marin_rl_core.learner.group import gathered_for_serving
            from marin_rl_core.models.build import publish_copy

            self._enter("publishing weights")
            self.group.send(PUBLISH, self.step)  # a group gathers the weights on its leader
            dtype = self.config.model.resolved_inference_dtype  # the engines': half for bf16
            if self.lora and self.config.resources.colocate is True:
                weights = sampled_in_place(self.model, dtype)  # the base is not copied
            else:
                weights = publish_copy(self._served(), dtype)
            weights = gathered_for_serving(weights)
            if self.weight_server is not None:
                self.weight_server.publish(weights, weight_step=self.step)
            self._published_step = self.step
            self.group.done()

    def _kept(self) -> str:
        if self.last_checkpoint_step is None:
            return "No checkpoint had been written yet: start the run again"
        return (
            f"The last good checkpoint (step {self.last_checkpoint_step}) is kept in "
            f"{self.run_dir / 'checkpoints'}: resume from it with `marinrl run --resume "
            f"{absolute(self.run_dir)} --set ...`"
        )

    def checkpoint(self) -> Path:
        """Write a checkpoint of the current state, refusing parameters that are not finite.

        Raises:
            TrainingDivergedError: a parameter is NaN or infinite (the update of a step whose
                loss was still finite can do that): the last good checkpoint stays the newest.
        """
        self._enter("writing a checkpoint")
        self.group.send(CHECKPOINT, self.step)  # every process of a group writes its shards
        if not all_finite(self.state.model):
            raise TrainingDivergedError(
                f"training diverged at step {self.step}: the parameters are no longer finite. "
                f"{self._kept()}; lower trainer.learning_rate or trainer.max_grad_norm."
            )
        replay_data, replay_state = self.replay.state_dict()
        # Taken with the replay buffer's state: every batch read up to here is in it or trained.
        position = None if self.reader is None else self.reader.position()
        path = save_checkpoint(
            self.run_dir,
            self.step,
            trainer_state=self.state.saveable_state if self.lora else self.state,
            state={
                **({BASE_KEY: self._lora_base} if self.lora else {}),
                "curriculum": self._curriculum_state(),
                "replay_buffer": replay_state,
                "rollout_positions": {str(k): v for k, v in self.rollout_positions.items()},
                "storage_position": position,
            },
            files={REPLAY_FILE: replay_data},
        )
        self.last_checkpoint_step = self.step
        if self.reader is not None:
            self.reader.checkpointed(position)  # storage may now forget those batches
        upload_now()  # a run directory on a bucket: samples and log as far as the checkpoint
        self._on_checkpoint(self.step)
        self.group.done()
        return path

    # --- the loop -----------------------------------------------------------------------------

    def _wait_for_batch(self) -> tuple[list[Rollout], np.ndarray, float] | None:
        """Read rollouts until the buffer can fill a batch; ``None`` if asked to stop."""
        start = self._enter("waiting for rollouts")
        size = self.config.trainer.batch_size
        while not self._stop.is_set():
            sampled = self.replay.sample(size)
            if sampled is not None:
                # Not short of rollouts (paced workers ask) while the first step compiles.
                self._enter("starting a training step")
                rollouts, advantages = sampled
                return (
                    list(rollouts),
                    np.asarray(advantages, dtype=np.float32),
                    time.monotonic() - start,
                )
            if self.reader is None:
                raise RuntimeError("this trainer has no rollout storage to read from")
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

    def train_one_step(self, rollouts: list[Rollout], advantages: np.ndarray) -> dict[str, float]:
        """One trainer step on ``rollouts``: one optimizer update, or the loss's epochs over its
        minibatches (:class:`~marin_rl_core.protocols.LossPlan`), after the loss's
        preparation (:class:`~marin_rl_core.learner.step_updates.StepUpdates`). Returns the
        step's metrics (host floats; the means over its updates)."""
        self.group.send(STEP, self.step, rollouts, advantages)  # the same step on every process
        batches = self.updates.minibatches(rollouts, advantages, step=self.step)
        start = self._enter("in a training step")
        try:
            state, metrics = self.updates.run(self.state, batches, step=self.step)
        except NonFiniteUpdate as bad:
            # The step's row, as far as it got, before the job stops.
            self._log({**bad.metrics, "diverged": 1.0}, step=self.step + 1, source="train")
            raise TrainingDivergedError(
                non_finite_advice(
                    f"training diverged at step {self.step + 1}{bad.where}",
                    bad.bad,
                    bad.metrics,
                    params_finite=bad.params_finite,
                    kept=self._kept(),
                    loss=self.config.loss.name,
                    precision=self.config.trainer.precision,
                )  # fmt: skip
            ) from None
        metrics["step_seconds"] = time.monotonic() - start
        self.state, self.step = state, self.step + 1
        self.group.done()
        return metrics

    def run(self) -> int:
        """Train until ``num_train_steps`` or a stop request; returns the step reached.

        A checkpoint is written at the end either way; weights of the final step are published.
        In a trainer group the leader runs this and stops its followers (:meth:`follow`) after.
        """
        try:
            return self._run()
        finally:
            if self.group.pending is None:  # (a failed collective step failed them alike)
                self.group.send(STOP, self.step)

    def follow(self) -> int:
        """A follower of a trainer group: take each collective operation its leader commands
        (:mod:`~marin_rl_core.learner.group`) until it stops; returns the step reached."""
        while True:
            op, rollouts, advantages = self.group.receive(self.step)
            if op == STOP:
                return self.step
            if op == STEP:
                self.train_one_step(rollouts, advantages)
            else:
                {PUBLISH: self.publish, CHECKPOINT: self.checkpoint}[op]()

    def _run(self) -> int:
        total = self.config.trainer.num_train_steps
        t = self.config.trainer
        self.publish()
        # (no warm-up in a trainer group: it places collectively)
        warm = self.step < total and not self.group.grouped
        warm_up = (
            self.updates.start_warm_up(self.state, self._first_rollout_tokens) if warm else None
        )
        # Seconds per stage, summed over the steps since the last logged row: each row holds
        # their means per step, so rows average to the true split whatever log_every is.
        stages: dict[str, float] = dict.fromkeys(STAGE_KEYS, 0.0)
        steps_since_log = 0
        while self.step < total:
            got = self._wait_for_batch()
            if got is None:
                if warm_up is not None:
                    warm_up.cancelled.set()  # stopped before any batch: nothing to warm up for
                break
            rollouts, advantages, waited = got
            if warm_up is not None:
                warm_up.finish()
                warm_up = None
            metrics = self.train_one_step(rollouts, advantages)
            self.replay.set_current_step(self.step)
            metrics.update(rollout_metrics(rollouts, trained_at=self.step - 1))
            updates_before = (self.step - 1) * self.plan.updates_per_step
            metrics["learning_rate"] = float(self._schedule(updates_before))
            metrics.update({f"replay/{k}": v for k, v in self.replay.metrics().items()})
            metrics.update(self._figures)  # (the first row after a start only)
            self._figures = {}
            metrics.update(device_memory())  # on accelerators: in use now, and the peak
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
            write_samples(
                self._samples, rollouts[: max(self.config.logging.samples_per_step, 0)],
                step=self.step, tokenizer=self.tokenizer,
            )  # fmt: skip
            if self.step % t.checkpoint_interval_steps == 0 or self.step == total:
                stages["checkpoint_seconds"] += _timed(self.checkpoint)
        if self.last_checkpoint_step != self.step:
            self.checkpoint()
        self.publish()
        return self.step
