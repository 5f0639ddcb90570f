"""The job's Ray actors: the trainer and rollout worker services, the job's hub (its metrics and
its curriculum in one actor) and the curriculum's proxy, and what each worker process sets up
(its log file under ``RUN_DIR/logs``)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs

from marin_rl_core.config.loading import resolve_config
from marin_rl_core.config.schema import RLJobConfig
from marin_rl_core.errors import (
    MarinRLError,
)
from marin_rl_core.metrics import MetricsHub
from marin_rl_core.pacing import PacingFeedback
from marin_rl_core.registry import Registry, RegistrySpec, registry_from_spec
from marin_rl_core.rundir import growing_file, upload_now

logger = logging.getLogger(__name__)
_UNSET: Any = object()

LOG_TIMEOUT_S = 60.0
"""How long the trainer waits for the metrics actor to write a step's row."""


@attrs.frozen(kw_only=True)
class WorkerConfig:
    """What one worker process needs to rebuild the driver's view of the run."""

    role: str
    """``"trainer"`` or ``"rollout"``."""
    index: int
    run_dir: str
    config: dict[str, Any]
    """The resolved run config as plain data (what ``config show`` prints)."""
    registry: RegistrySpec

    def resolve(self) -> tuple[RLJobConfig, Registry]:
        registry = registry_from_spec(self.registry)
        return resolve_config(registry, data=self.config), registry


class _LogFile(logging.FileHandler):
    """A log file that, once it cannot be written (a full disk), says so in one line and stops
    trying, instead of printing a traceback for every record."""

    _broken = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self._broken:
            super().emit(record)

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # the last flush onto a full disk: already said
            pass

    def handleError(self, record: logging.LogRecord) -> None:
        if not self._broken:
            self._broken = True
            error = sys.exc_info()[1]
            print(f"warning: cannot write {self.baseFilename} ({error}); logging to it stops",
                  file=sys.stderr)  # fmt: skip


def attach_log_file(path: Path) -> logging.Handler:
    """Send the root logger's records (INFO and up) to ``path`` too; returns the handler, for
    ``logging.getLogger().removeHandler`` and ``close``. Raises ``OSError`` when the file
    cannot be opened; one that stops being writable later says so once (:class:`_LogFile`)."""
    handler = _LogFile(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return handler


def _worker_logging(run_dir: str, name: str) -> None:
    """Each worker logs to ``RUN_DIR/logs/NAME.log`` (the driver's console keeps the progress bar;
    a run on a bucket logs to its local copy and uploads the log: :mod:`marin_rl_core.rundir`)."""
    attach_log_file(growing_file(run_dir, f"logs/{name}.log"))
    # httpx logs every request at INFO: an agent's OpenAI client makes thousands per step.
    for chatty in ("levanter", "jax", "datasets", "absl", "httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(logging.WARNING)


class CurriculumService:
    """The job's one curriculum policy, shared by all rollout workers (in the :class:`JobHub`
    actor)."""

    def __init__(self, wc: WorkerConfig):
        config, registry = wc.resolve()
        record = registry.get("curriculum", config.curriculum.name)
        self.policy = record.build(config.curriculum.config, config.curriculum.lessons)

    def load_state(self, state: dict[str, Any] | None) -> None:
        """Resume from a checkpoint's curriculum state (``None``: a new run)."""
        if state:
            self.policy.load_state_dict(state)

    def sample_lesson(self, seed: int) -> str:
        return self.policy.sample_lesson(seed=seed)

    def update_eval(self, stats: Any) -> None:
        self.policy.update_eval(stats)

    def update_training(self, stats: Any) -> None:
        self.policy.update_training(stats)

    def lesson_states(self) -> dict[str, str]:
        return self.policy.lesson_states()

    def state_dict(self) -> dict[str, Any]:
        return self.policy.state_dict()


class JobHub(MetricsHub, CurriculumService):
    """The job's metrics hub and its curriculum: one Ray actor, which every worker finds by its
    name. One process for both, not one each: a process costs a job ~1 CPU-second to start and
    ~100 MB to keep, and both are small (their calls are short, one at a time)."""

    def __init__(self, run_dir: str, trackers: Any, run_id: str, wc: WorkerConfig):
        MetricsHub.__init__(self, run_dir, trackers, run_id)
        CurriculumService.__init__(self, wc)
        self._warmed_up: dict[int, int | None] = {}

    def warmed_up(self, index: int, tokens: int | None) -> None:
        """Rollout worker ``index`` set up, its sampler warmed up on a batch whose longest
        rollout had ``tokens`` tokens (``None``: no warm-up, or nothing came of it)."""
        self._warmed_up.setdefault(int(index), None if tokens is None else int(tokens))

    def warm_up_tokens(self) -> tuple[bool, int | None]:
        """Whether a rollout worker has set up, and the longest rollout of its warm-up batch."""
        if not self._warmed_up:
            return False, None
        tokens = [t for t in self._warmed_up.values() if t is not None]
        return True, max(tokens) if tokens else None


class CurriculumProxy:
    """Gives a worker the :class:`~marin_rl_core.protocols.CurriculumPolicy` interface over the
    :class:`JobHub` actor's curriculum. Updates are fire-and-forget; reads wait."""

    def __init__(self, actor: Any):
        self._actor = actor

    def sample_lesson(self, *, seed: int) -> str:
        import ray

        return ray.get(self._actor.sample_lesson.remote(seed))

    def update_eval(self, stats: Any) -> None:
        self._actor.update_eval.remote(stats)

    def update_training(self, stats: Any) -> None:
        self._actor.update_training.remote(stats)

    def lesson_states(self) -> dict[str, str]:
        import ray

        return ray.get(self._actor.lesson_states.remote())

    def state_dict(self) -> dict[str, Any]:
        import ray

        return ray.get(self._actor.state_dict.remote())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError(
            "the job restores curriculum state with CurriculumService.load_state"
        )


class _SetUpError:
    """A :class:`MarinRLError` raised while an actor sets up (a trainer mesh that does not fit
    its devices, say) is kept and re-raised by its next method call: Ray reports an exception of
    an actor's ``__init__`` only as ``ActorDiedError``, without the exception itself, so the
    message and exit code would be lost. Any other exception kills the actor (a rollout worker is
    then restarted); its traceback goes to the actor's log first."""

    _setup_error: MarinRLError | None = None

    def _set_up(self, fn: Any) -> None:
        from marin_rl_core import deferred_imports

        deferred_imports.defer()  # before the set-up imports levanter
        try:
            fn()
        except MarinRLError as exc:
            logging.getLogger(__name__).exception("set-up failed")
            self._setup_error = exc
        except Exception:
            logging.getLogger(__name__).exception("set-up failed")
            raise

    def _check(self) -> None:
        if self._setup_error is not None:
            raise self._setup_error


def _job_actor(name: str, *, timeout: float = 60.0) -> Any:
    """The job's actor named ``name`` (its :class:`JobHub`).

    The driver creates the trainer and rollout workers before the hub, so that the two heavy
    processes start in the worker processes Ray has already started (issue 11); Ray registers a
    named actor before its creation call returns, so the name is there by the time a worker
    asks. Waiting a little is only for safety; a name still missing is a job error."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get_actor(name)
        except ValueError:
            if time.monotonic() > deadline:
                raise MarinRLError(
                    f"the job's actor {name!r} did not appear within {timeout:.0f} s; the driver "
                    "may have died while starting the job: run it again"
                ) from None
            time.sleep(0.05)


WARM_UP_WAIT_S = 120.0
"""How long the trainer's step warm-up waits to hear how long the rollout workers' first
rollouts are (their own warm-up batch); then it warms up for short ones."""


def _forked() -> str:
    """What the process's first log line adds where it was forked from the local Ray's fork
    server (:mod:`marin_rl_core.job.worker_fork`)."""
    server = os.environ.get("MARINRL_FORKED_FROM")
    return f", forked from the job's fork server (process {server})" if server else ""


def _warm_up_tokens(hub: Any, cancelled: threading.Event) -> int | None:
    """The longest rollout of a rollout worker's warm-up batch, once one has set up (``None``:
    none said within :data:`WARM_UP_WAIT_S`, or ``cancelled`` was set: the first batch came)."""
    import ray

    deadline = time.monotonic() + WARM_UP_WAIT_S
    while not cancelled.is_set() and time.monotonic() < deadline:
        try:
            ready, tokens = ray.get(hub.warm_up_tokens.remote(), timeout=LOG_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a hint only: warm up for short rollouts
            return None
        if ready:
            return tokens
        cancelled.wait(0.2)
    return None


class TrainerService(_SetUpError):
    """The trainer process (a Ray actor). ``ready()`` returns once its weight server is up.

    Like :class:`RolloutService` it finds the job's hub (metrics and curriculum) by its name.
    ``group`` (``(coordinator, hosts)``): it is process 0 of a trainer over several hosts, whose
    others follow it (:mod:`marin_rl_core.job.trainer_group`)."""

    def __init__(
        self,
        wc: WorkerConfig,
        storage: Any,
        hub: str,
        group: tuple[str, int] | None = None,
        *,
        transfer: Any = None,
    ):
        self._set_up(lambda: self._build(wc, storage, hub, group, transfer))

    def _build(
        self,
        wc: WorkerConfig,
        storage: Any,
        hub_name: str,
        group: tuple[str, int] | None,
        transfer: Any,
    ) -> None:
        _worker_logging(wc.run_dir, "trainer")
        import ray

        logger.info(
            "trainer process %d on node %s (%s), niceness %d%s",
            os.getpid(), ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
            os.nice(0), _forked(),
        )  # fmt: skip
        if group is not None:  # before anything touches the devices
            from marin_rl_core.learner import multihost

            multihost.join(group[0], group[1], 0)
        hub = _job_actor(hub_name)
        from marin_rl_core.job import compile_cache
        from marin_rl_core.learner.trainer import Trainer

        config, registry = wc.resolve()
        compile_cache.enable(config.compilation_cache)
        if transfer is None:  # (a colocated process passes its in-process one)
            transfer = registry.get("weight_transfer", config.weight_transfer.name).build(
                config.weight_transfer.config
            )
        self.server = transfer.server()
        proxy = CurriculumProxy(hub)
        self.trainer = Trainer(
            config,
            registry,
            run_dir=wc.run_dir,
            storage=storage,
            weight_server=self.server,
            # Awaited: a step's row is in metrics.jsonl before its checkpoint is written.
            log=lambda metrics, *, step, source: ray.get(
                hub.log.remote(metrics, step=step, source=source), timeout=LOG_TIMEOUT_S
            ),
            curriculum_state=proxy.state_dict,
            # metrics.jsonl on a bucket as far as the checkpoint (not awaited: an upload never
            # holds training up).
            on_checkpoint=lambda step: hub.upload.remote(),
            first_rollout_tokens=lambda cancelled: _warm_up_tokens(hub, cancelled),
        )

    def ready(self) -> dict[str, Any]:
        """The weight server's address, the step it starts from, the curriculum state and each
        rollout worker's next batch (``positions``) of the checkpoint it restored, and warnings
        for the user (damaged checkpoints it skipped)."""
        self._check()
        return {
            "address": self.server.address,
            "step": self.trainer.step,
            "curriculum": self.trainer.resumed_state.get("curriculum"),
            "positions": dict(self.trainer.rollout_positions),
            "warnings": list(self.trainer.resume_warnings),
        }

    def diagnostics(self) -> dict[str, Any]:
        self._check()
        return self.trainer.diagnostics()

    def pacing_feedback(self, worker_id: str, worker_index: int) -> PacingFeedback:
        """See :meth:`marin_rl_core.learner.trainer.Trainer.pacing_feedback` (paced workers ask)."""
        self._check()
        return self.trainer.pacing_feedback(worker_id, worker_index)

    def run(self) -> int:
        self._check()
        try:
            return self.trainer.run()
        finally:
            logging.getLogger(__name__).info("trainer stopped at step %d", self.trainer.step)

    def stop(self) -> None:
        if self._setup_error is None:
            self.trainer.request_stop()

    def step(self) -> int:
        self._check()
        return self.trainer.step

    def close(self) -> None:
        if self._setup_error is None:
            self.server.close()
        upload_now()  # a run directory on a bucket: the log as far as here


class RolloutService(_SetUpError):
    """One rollout worker process (a Ray actor), restarted by Ray when its process dies.

    It finds the job's hub (metrics and curriculum) by its actor name: Ray re-runs the
    constructor of a restarted actor with the same arguments, and actor handles among them
    would have to stay pinned for that (Ray says so on the console)."""

    def __init__(
        self,
        wc: WorkerConfig,
        storage: Any,
        hub: str,
        *,
        transfer: Any = None,
        initial_model: Any = None,
    ):
        self._connected = False
        self._set_up(lambda: self._build(wc, storage, hub, transfer, initial_model))

    def _build(
        self,
        wc: WorkerConfig,
        storage: Any,
        hub_name: str,
        transfer: Any,
        initial_model: Any,
    ) -> None:
        _worker_logging(wc.run_dir, f"rollout-{wc.index}")
        import ray

        hub = _job_actor(hub_name)
        # Awaited (a call still in flight is lost with a process killed right after): a
        # restart during set-up is then counted by the driver.
        ray.get(hub.worker_started.remote(wc.index, os.getpid()), timeout=LOG_TIMEOUT_S)

        logger.info(
            "rollout worker %d process %d on node %s (%s), niceness %d%s",
            wc.index,
            os.getpid(),
            ray.get_runtime_context().get_node_id(),
            ray.util.get_node_ip_address(),
            os.nice(0),
            _forked(),
        )
        from marin_rl_core.job import compile_cache
        from marin_rl_core.rollout.worker import RolloutWorker

        config, registry = wc.resolve()
        compile_cache.enable(config.compilation_cache)
        self._transfer = transfer or registry.get(
            "weight_transfer", config.weight_transfer.name
        ).build(config.weight_transfer.config)
        self.worker = RolloutWorker(
            config,
            registry,
            worker_index=wc.index,
            writer=storage.writer(name=f"rollout-{wc.index}"),
            weight_client=None,  # connected in run(), once the trainer's server is up
            curriculum=CurriculumProxy(hub),
            log=lambda metrics, *, step, source: hub.log.remote(metrics, step=step, source=source),
            samples=lambda rows: hub.samples.remote(rows),
            model=initial_model,  # (colocated: the trainer's weights, handed over)
        )
        self.worker.warm_up()  # compiles while the trainer sets up
        hub.warmed_up.remote(wc.index, self.worker.warm_up_tokens)  # the trainer's warm-up waits
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self.worker.seed_salt += int.from_bytes(os.urandom(4), "little") << 32
            logger.warning("rollout worker %d restarted after its process died", wc.index)

    def run(self, address: str, start_batch: int = 0, trainer: Any = None) -> dict[str, int]:
        """Connect to the trainer's weight server at ``address`` (the first time; the worker sets
        up before the trainer is ready) and generate from batch ``start_batch`` on until
        stopped. ``trainer`` (its actor) tells a paced worker when it is short of rollouts."""
        self._check()
        self._connect(address, start_batch, trainer)
        return self.worker.run()

    def _connect(self, address: str, start_batch: int = 0, trainer: Any = None) -> None:
        if self._connected:
            return
        self.worker.weight_client = self._transfer.client(address)
        self.worker.next_batch = start_batch
        if trainer is not None:
            import ray

            worker_id, worker_index = self.worker.worker_id, self.worker.worker_index
            self.worker.pacer.ask = lambda: ray.get(
                trainer.pacing_feedback.remote(worker_id, worker_index), timeout=5.0
            )
        self._connected = True

    def stop(self) -> None:
        if self._setup_error is None:
            self.worker.request_stop()
        upload_now()  # a run directory on a bucket: the log as far as here

    def final_eval(self, step: int, address: str, timeout: float) -> dict[str, float]:
        """Evaluate the weights of ``step``, pulled from the trainer's server at ``address``
        (a worker restarted after its last run was handed out has not connected yet)."""
        self._check()
        self._connect(address)
        return self.worker.final_eval(step, timeout=timeout)

    def counters(self) -> dict[str, int]:
        self._check()
        return self.worker.counters()

    def process(self) -> int:
        """This worker's process id (a restarted worker has a new one)."""
        return os.getpid()
