"""``RLJob``: one trainer and N rollout workers as Ray actors, from one :class:`RLJobConfig`.

The driver (``marinrl run`` or ``RLJob(config, registry).run()``):

1. validates the config (before anything is written);
2. joins ``ray_address`` (after checking that something answers there) or starts a local Ray
   with token authentication, and checks that the cluster can place every actor;
3. only then creates the run directory, writes ``config.toml`` (run directory absolute) and
   opens ``driver.log``;
4. starts the trainer and the job's hub (metrics and curriculum, one actor), and waits until it is
   ready: weights built or restored from the newest intact checkpoint (a damaged newer one is
   skipped, with a warning), weight server up; the curriculum resumes from the same checkpoint;
5. starts the rollout workers, pointed at the trainer's weight server and the rollout storage;
6. watches (:class:`Watch`): a progress bar until the trainer reaches ``num_train_steps``; a
   rollout worker whose process dies is restarted (``faults.worker_restarts``, with backoff);
   a watchdog stops a job in which no step completes for ``faults.stall_timeout_s`` and says
   why; then it stops the rollout workers, has worker 0 evaluate the final weights, and
   returns. Every wait is bounded (``faults.stop_timeout_s``).

Every worker gets the config as plain data plus the driver's :class:`RegistrySpec`; it rebuilds
the registry and refuses to start if its plugins differ from the driver's. Ctrl-C, SIGTERM (via
``marinrl run``), a stalled job and a lost worker stop the trainer with a checkpoint first;
``marinrl run --resume RUN_DIR`` goes on from it. Failures reach the caller as
:class:`~marin_rl_core.errors.MarinRLError` s with their exit codes (docs/faults.md).
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from marin_rl_core.config.converter import dump_config, unstructure_config
from marin_rl_core.config.loading import resolve_config
from marin_rl_core.config.schema import RLJobConfig
from marin_rl_core.errors import ClusterError, ConfigError, MarinRLError, with_resume_command
from marin_rl_core.job.actors import (
    JobHub,
    RolloutService,
    WorkerConfig,
    attach_log_file,
)
from marin_rl_core.job.checks import (
    RUN_DIR_ERRNOS,
    bucket_error,
    check_model,
    check_resources,
    check_run_dir_filesystem,
    check_run_dir_writable,
    checked_storage,
    first_line,
    preflight_problems,
    probe_ray_address,
    resume_conflicts,
    run_dir_error,
)
from marin_rl_core.job.local_ray import LocalRay, handle_sigterm
from marin_rl_core.job.memory import check_memory
from marin_rl_core.job.trainer_group import start_trainer, wait_until_ready
from marin_rl_core.job.watch import Watch
from marin_rl_core.registry import Registry
from marin_rl_core.rundir import (
    absolute,
    growing_file,
    is_remote,
    local_copy,
    upload_now,
    write_text,
)

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class JobResult:
    """What :meth:`RLJob.run` returns."""

    run_dir: Path
    final_step: int
    interrupted: bool
    final_eval: dict[str, Any]
    rollout_counters: list[dict[str, int]]
    ray_address: str = ""
    """The GCS address of the Ray cluster the job ran on (given, or the local one it started)."""

    def load_model(self) -> Any:
        """The trained policy, read from the run's final checkpoint."""
        from marin_rl_core.learner.export import trained_model
        from marin_rl_core.registry import build_registry

        return trained_model(self.run_dir, build_registry())[0]

    def export(self, out_dir: str | Path) -> Path:
        """Write the trained policy as a Hugging Face checkpoint directory (what ``marinrl
        export RUN_DIR OUT_DIR`` does); ``transformers`` loads it with ``from_pretrained``."""
        from marin_rl_core.learner.export import export_hf
        from marin_rl_core.registry import build_registry

        return export_hf(self.run_dir, out_dir, build_registry())[0]


class RLJob:
    """A configured RL training job. ``run()`` trains; ``to_worker_configs()`` shows what each
    worker would get.

    Args:
        config: a resolved config (from :func:`~marin_rl_core.config.resolve_config`).
        registry: the registry the config was resolved with (workers rebuild it from its spec).
    """

    def __init__(self, config: RLJobConfig, registry: Registry):
        self.config = config
        self.registry = registry
        check_run_dir_filesystem(config.run_dir)  # s3:// without s3fs: said before anything
        self.run_id = config.run_id or time.strftime("rl-%Y%m%d-%H%M%S")
        # Absolute, so the saved config and the printed resume command work from anywhere. A
        # run on a bucket (gs://...) appends its logs and metrics in a local copy, uploaded.
        self.run_dir = absolute(config.run_dir) / self.run_id
        self.local_dir = local_copy(self.run_dir)
        check_run_dir_writable(self.run_dir)  # before Ray and the workers start
        self._local_ray: LocalRay | None = None
        self._log_handler: logging.Handler | None = None
        self.validate()

    def saved_config(self) -> RLJobConfig:
        """The config as ``config.toml`` keeps it: run id and absolute run directory filled in."""
        return attrs.evolve(self.config, run_id=self.run_id, run_dir=str(self.run_dir.parent))

    def validate(self) -> None:
        """Checks beyond the config's own: sequence lengths fit the model, lessons exist."""
        errors = []
        max_seq = self.config.model.max_seq_len
        for i, lesson in enumerate(self.config.curriculum.lessons):
            sampling = self.config.sampling_for(lesson)
            if sampling.max_tokens >= max_seq:
                where = f"$.curriculum.lessons[{i}].sampling" if lesson.sampling else "$.sampling"
                errors.append(
                    f"{where}.max_tokens ({sampling.max_tokens}) leaves no room for a prompt in "
                    f"$.model.max_seq_len ({max_seq})"
                )
            evaluating = self.config.eval_sampling_for(lesson)
            if evaluating.max_tokens >= max_seq:
                where = (
                    f"$.curriculum.lessons[{i}].eval_sampling"
                    if lesson.eval_sampling
                    else "$.eval.sampling"
                )
                errors.append(f"{where}.max_tokens must be < $.model.max_seq_len ({max_seq})")
        if errors and not self.config.model.checkpoint:  # so far only lengths that do not fit
            errors.append(
                "the model is the tiny default one (arithmetic tokens, "
                f"{max_seq} positions): an env of text or code needs a Hugging Face "
                "checkpoint, --model PATH_OR_NAME (docs/hf-models.md)"
            )
        if not self.config.curriculum.lessons:
            errors.append("$.curriculum.lessons: a job needs at least one lesson")
        engine = self.registry.get("engine", self.config.engine.name)
        if not engine.exact_logprobs:  # type: ignore[attr-defined]
            exact = [
                e.name
                for e in self.registry.entries("engine")
                if e.record.exact_logprobs  # type: ignore[attr-defined]
            ]
            errors.append(
                f"$.engine.name: the {engine.name} engine does not report the logprobs the "
                "trainer computes, and every loss's importance ratio rests on them: train with "
                f"one that does ({', '.join(exact)}); it can still evaluate (marinrl eval)"
            )
        self._check_resume()
        errors += check_model(self.config)
        errors += preflight_problems(self.config, self.registry)
        if errors:
            lines = dict.fromkeys(errors)  # a run-wide setting is reported once, not per lesson
            raise ConfigError("invalid job config:\n" + "\n".join(f"  {e}" for e in lines))
        self.memory_estimate = check_memory(self.config, self.registry)  # its line, or ""

    def _check_resume(self) -> None:
        """A run directory that already holds a run is resumed: its checkpoints must load with
        this config. Raises :class:`ConfigError` naming each setting that changes what they
        hold, before anything is written (the saved ``config.toml`` stays as it was)."""
        saved_file = self.run_dir / "config.toml"
        if not saved_file.is_file():
            return
        try:
            saved = resolve_config(self.registry, files=[saved_file])
        except MarinRLError as exc:
            logger.warning("the saved config of %s does not resolve: %s", self.run_dir, exc)
            return  # the checkpoint load says what is wrong, if anything
        conflicts = resume_conflicts(saved, self.config, self.run_dir)
        if conflicts:
            raise ConfigError(
                f"--resume {self.run_dir}: these settings change what the run's checkpoints hold, "
                "so they could not be loaded:\n"
                + "\n".join(f"  {c}" for c in conflicts)
                + "\nDrop those --set values to resume, or start a new run (another --run-id) "
                "with them. The saved run is unchanged."
            )

    def to_worker_configs(self) -> tuple[WorkerConfig, list[WorkerConfig]]:
        """``(trainer, [rollout worker, ...])`` configs, exactly as the actors receive them."""
        data = unstructure_config(self.saved_config(), self.registry)
        spec = self.registry.spec

        def make(role: str, index: int) -> WorkerConfig:
            return WorkerConfig(
                role=role, index=index, run_dir=str(self.run_dir), config=data, registry=spec
            )

        return make("trainer", 0), [
            make("rollout", i) for i in range(self.config.num_rollout_workers)
        ]

    def _start_ray(self) -> bool:
        """Join ``ray_address`` (checked to answer first) or start a local Ray with token
        authentication; returns whether this call started (and so must stop) Ray."""
        import ray

        if ray.is_initialized():
            return False
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        address = self.config.ray_address
        if address:
            probe_ray_address(address)
            try:
                ray.init(address=address, log_to_driver=False)
            except Exception as exc:  # a version mismatch, an auth token it refuses, ...
                raise ClusterError(
                    f"could not join the Ray cluster at {address} ($.ray_address / "
                    f"--ray-address): {type(exc).__name__}: {first_line(exc)}. Check that it is "
                    "a Ray head of the same Ray version (`ray status --address ADDRESS`)."
                ) from exc
            return True
        self._local_ray = LocalRay()
        try:
            address = self._local_ray.start()
        except Exception as exc:  # its raylet, GCS or dashboard agent did not come up
            self._local_ray = None  # (stopped by start() itself)
            logs = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), "ray", "session_latest")
            raise ClusterError(
                f"the job's local Ray did not start: {type(exc).__name__}: {first_line(exc)}. "
                f"Ray's own logs are in {logs}/logs (raylet.out, gcs_server.out, "
                "dashboard_agent.log). A machine short of memory or CPU while it starts is the "
                "usual cause: run the job again, or start Ray yourself (`ray start --head`) and "
                "pass its address with --ray-address."
            ) from exc
        if not address.startswith(("127.", "[::1]", "localhost")):
            logger.warning("the local Ray instance listens at %s, not on loopback only", address)
        return True

    def _stop_ray(self) -> None:
        import ray

        if self._local_ray is not None:
            self._local_ray.stop()
            self._local_ray = None
        else:
            ray.shutdown()

    def _write_run_dir(self, config: RLJobConfig) -> None:
        """Create the run directory, write ``config.toml`` and open ``driver.log``: only after
        every check passed, so a bad resume leaves the saved run as it was."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if not (self.run_dir / "config.toml").exists():
                self._save_config(config)
            # A resume's config replaces the saved one only once the trainer has restored a
            # checkpoint with it (_run_actors): a resume that fails leaves the run resumable.
            self._log_handler = attach_log_file(growing_file(self.run_dir, "driver.log"))
        except Exception as exc:
            if is_remote(self.run_dir):  # each bucket's client raises errors of its own
                raise bucket_error(exc, self.run_dir) from None
            if isinstance(exc, OSError):
                raise run_dir_error(exc, self.run_dir, resumable=False) from None
            raise

    def _save_config(self, config: RLJobConfig) -> None:
        """Write ``config.toml`` whole or not at all (a crash mid-write keeps the old one)."""
        write_text(self.run_dir / "config.toml", dump_config(config, self.registry))

    @property
    def driver_log(self) -> Path:
        """Where this process logs (the local copy of a run on a bucket)."""
        return self.local_dir / "driver.log"

    def resume_command(self) -> str:
        return f"marinrl run --resume {self.run_dir}"

    def run(
        self, *, progress: bool = True, on_start: Callable[[], None] | None = None
    ) -> JobResult:
        """Train to ``num_train_steps`` (or Ctrl-C / SIGTERM); see the module docstring.

        ``on_start`` is called once the cluster is reached and the run directory written (the
        CLI says "writing to RUN" then, not before a cluster that cannot be reached).

        Raises:
            MarinRLError: a user-facing error with its exit code: the cluster cannot be reached
                (:class:`ClusterError`) or cannot place the job, the run directory cannot be
                written (:class:`RunDirError`), no intact checkpoint to resume, a stalled job
                (:class:`StalledError`), a worker lost for good (:class:`WorkerLostError`), a
                diverged loss; anything else as a :class:`MarinRLError` naming the log that
                holds its traceback. A running job stops with a final checkpoint first.
        """
        import ray

        config = self.saved_config()
        storage = checked_storage(config, self.registry, self.run_id, self.run_dir)  # before Ray
        started_ray, restore_sigterm = False, None
        try:
            started_ray = self._start_ray()
            # After ray.init, which installs its own SIGTERM handler (exit 1, no checkpoint).
            restore_sigterm = handle_sigterm()
            ray_address = ray.get_runtime_context().gcs_address
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            check_resources(config, [n["Resources"] for n in nodes])
            self._write_run_dir(config)
            if on_start is not None:
                on_start()
            if self.memory_estimate:
                logger.info("%s", self.memory_estimate)
            logger.info(
                "%s Ray cluster at %s: %d node(s) at %s",
                "started a local" if started_ray and not config.ray_address else "using the",
                ray_address,
                len(nodes),
                ", ".join(str(n.get("NodeManagerAddress")) for n in nodes),
            )
            try:
                return self._run_actors(config, storage, ray_address, progress)
            except Exception as exc:
                raise self._user_error(exc) from None
        finally:
            if restore_sigterm is not None:
                restore_sigterm()
            try:
                storage.close()
            except Exception:  # noqa: BLE001 - e.g. the queue actor already gone with Ray
                logger.debug("closing the rollout storage failed", exc_info=True)
            if started_ray:
                self._stop_ray()  # (what the fork server said goes into driver.log)
            if self._log_handler is not None:
                logging.getLogger().removeHandler(self._log_handler)
                self._log_handler.close()
                self._log_handler = None
            upload_now()  # a run directory on a bucket: driver.log as far as here

    def _user_error(self, exc: BaseException) -> MarinRLError:
        """What the user is told about ``exc`` (a worker's error arrives wrapped by Ray); the
        traceback goes to ``driver.log``."""
        cause = getattr(exc, "cause", None) or exc
        if isinstance(cause, MarinRLError):
            return with_resume_command(cause, self.resume_command())
        logger.error("the job failed", exc_info=exc)
        if isinstance(cause, OSError) and cause.errno in RUN_DIR_ERRNOS:
            return run_dir_error(cause, self.run_dir, resumable=True)
        if "No space left on device" in str(cause):  # TensorStore's errors are not OSErrors
            return run_dir_error(
                OSError(errno.ENOSPC, "No space left on device", str(self.run_dir)),
                self.run_dir,
                resumable=True,
            )
        return MarinRLError(
            f"the job failed: {type(cause).__name__}: {first_line(cause)}. The traceback is in "
            f"{self.driver_log} and the workers' logs in {self.local_dir / 'logs'}; the last "
            f"checkpoint is kept (resume with `{self.resume_command()}`)."
        )

    def _run_actors(
        self, config: RLJobConfig, storage: Any, ray_address: str, progress: bool
    ) -> JobResult:
        import ray

        trainer_wc, rollout_wcs = self.to_worker_configs()
        faults = config.faults
        actors: list[Any] = []
        placed = None  # the trainer hosts' placement group
        try:
            hub_name = f"marinrl-{self.run_id}-{os.urandom(4).hex()}-hub"
            # The trainer and rollout workers first, the hub (metrics and curriculum) after
            # them: the workers find it by name. (Each actor's process is started for it; on
            # a local Ray, forked from the job's fork server.)
            # (A trainer over several hosts: one actor per host, placed together.)
            colocated = config.resources.colocate is True
            trainer, followers, placed = start_trainer(
                config, trainer_wc, storage, hub_name,
                rollout_wcs[0] if colocated else None,
            )  # fmt: skip
            actors += [trainer, *followers]
            # The rollout workers set up (model, sampler, envs) while the trainer does; they
            # connect to its weight server when they are handed their run. (A colocated job's
            # one worker is in the trainer's process.)
            rollouts: list[Any] = [
                ray.remote(RolloutService)
                .options(
                    **config.resources.rollout.ray_options(),
                    max_concurrency=4,
                    max_restarts=faults.worker_restarts,
                    max_task_retries=0,
                )
                .remote(wc, storage, hub_name)
                for wc in ([] if colocated else rollout_wcs)
            ]
            actors += rollouts
            if colocated:
                from marin_rl_core.job.colocated import RolloutView

                rollouts = [RolloutView(trainer)]
                logger.info("colocated: the trainer and rollout worker 0 share one process")
            hub = (
                ray.remote(JobHub)
                .options(num_cpus=0, name=hub_name)
                .remote(str(self.run_dir), config.logging.tracker, self.run_id, trainer_wc)
            )
            actors.append(hub)
            info = wait_until_ready([trainer, *followers], self.local_dir / "logs")
            for warning in info["warnings"]:
                logger.warning("%s", warning)
                print(f"warning: {warning}", file=sys.stderr)
            try:
                self._save_config(config)  # the checkpoint (if any) loaded with this config
            except OSError as exc:
                raise run_dir_error(exc, self.run_dir, resumable=True) from None
            # The curriculum resumes from the checkpoint the trainer restored, and the metrics
            # of steps after it (logged by the run that died) give way to the steps trained again.
            ray.get(hub.load_state.remote(info["curriculum"]))
            start_step = int(info["step"])
            # Each rollout worker goes on after the last batch the checkpoint received, so the
            # resumed run draws the problems the uninterrupted one would have drawn.
            positions = {int(k): int(v) for k, v in info["positions"].items()}
            # (A run resumed before its first checkpoint starts again at step 0.)
            dropped = ray.get(hub.resume_at.remote(start_step))
            if start_step or dropped:
                logger.info(
                    "resuming at step %d (%d metric rows dropped: of later steps, and its eval, done again)",
                    start_step,
                    dropped,
                )
            watch = Watch(self, trainer, rollouts, hub, start_step, info["address"], positions)
            watch.follow_hosts(followers)
            interrupted = False
            try:
                final_step = watch.run(progress)
            except KeyboardInterrupt:
                interrupted = True
                logger.warning("interrupted: stopping the trainer, which writes a checkpoint")
                final_step = watch.stop_trainer()
            except BaseException:
                # A stalled job or a lost worker: keep what the trainer has, then report.
                watch.stop_trainer()
                raise
            counters = watch.stop_rollouts()
            final_eval: dict[str, Any] = {}
            if not interrupted:
                final_eval = watch.final_eval(final_step)
            for actor in [trainer, *followers]:
                ray.get(actor.close.remote(), timeout=faults.stop_timeout_s)
            ray.get(hub.close.remote(), timeout=faults.stop_timeout_s)
        finally:
            for actor in actors:
                ray.kill(actor)
            if placed is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(placed)
        return JobResult(
            run_dir=self.run_dir,
            final_step=final_step,
            interrupted=interrupted,
            final_eval=final_eval,
            rollout_counters=counters,
            ray_address=ray_address,
        )
