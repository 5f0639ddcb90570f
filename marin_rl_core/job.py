"""``RLJob``: one trainer and N rollout workers as Ray actors, from one :class:`RLJobConfig`.

The driver (``marinrl run`` or ``RLJob(config, registry).run()``):

1. validates the config (before anything is written);
2. joins ``ray_address`` (after checking that something answers there) or starts a local Ray
   with token authentication, and checks that the cluster can place every actor;
3. only then creates the run directory, writes ``config.toml`` (run directory absolute) and
   opens ``driver.log``;
4. starts the shared actors (metrics hub, curriculum) and the trainer, and waits until it is
   ready: weights built or restored from the newest intact checkpoint (a damaged newer one is
   skipped, with a warning), weight server up; the curriculum resumes from the same checkpoint;
5. starts the rollout workers, pointed at the trainer's weight server and the rollout storage;
6. watches (:class:`_Watch`): a progress bar until the trainer reaches ``num_train_steps``; a
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

import contextlib
import errno
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from marin_rl_core.config import RLJobConfig, dump_config, resolve_config, unstructure_config
from marin_rl_core.errors import (
    ClusterError,
    ConfigError,
    MarinRLError,
    RunDirError,
    StalledError,
    WorkerLostError,
)
from marin_rl_core.registry import Registry, RegistrySpec, registry_from_spec

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
    """Each worker logs to ``RUN_DIR/logs/NAME.log`` (the driver's console keeps the progress bar)."""
    path = Path(run_dir) / "logs"
    path.mkdir(parents=True, exist_ok=True)
    attach_log_file(path / f"{name}.log")
    for chatty in ("levanter", "jax", "datasets", "absl"):
        logging.getLogger(chatty).setLevel(logging.WARNING)


class CurriculumService:
    """The job's one curriculum policy, shared by all rollout workers (a Ray actor)."""

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


class CurriculumProxy:
    """Gives a worker the :class:`~marin_rl_core.protocols.CurriculumPolicy` interface over the
    :class:`CurriculumService` actor. Updates are fire-and-forget; reads wait."""

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
    message and exit code would be lost."""

    _setup_error: MarinRLError | None = None

    def _set_up(self, fn: Any) -> None:
        try:
            fn()
        except MarinRLError as exc:
            logging.getLogger(__name__).exception("set-up failed")
            self._setup_error = exc

    def _check(self) -> None:
        if self._setup_error is not None:
            raise self._setup_error


def _job_actor(name: str, *, timeout: float = 60.0) -> Any:
    """The job's actor named ``name`` (its metrics hub or curriculum).

    The driver creates the trainer and rollout workers before these two, so that the two heavy
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


class TrainerService(_SetUpError):
    """The trainer process (a Ray actor). ``ready()`` returns once its weight server is up.

    Like :class:`RolloutService` it finds the job's curriculum and metrics hub by their names."""

    def __init__(self, wc: WorkerConfig, storage: Any, curriculum: str, hub: str):
        self._set_up(lambda: self._build(wc, storage, curriculum, hub))

    def _build(self, wc: WorkerConfig, storage: Any, curriculum_name: str, hub_name: str) -> None:
        _worker_logging(wc.run_dir, "trainer")
        logger.info("trainer process %d", os.getpid())
        curriculum, hub = _job_actor(curriculum_name), _job_actor(hub_name)
        import ray

        from marin_rl_core import compile_cache
        from marin_rl_core.trainer import Trainer

        config, registry = wc.resolve()
        compile_cache.enable(config.compilation_cache)
        transfer = registry.get("weight_transfer", config.weight_transfer.name).build(
            config.weight_transfer.config
        )
        self.server = transfer.server()
        proxy = CurriculumProxy(curriculum)
        self.trainer = Trainer(
            config,
            registry,
            run_dir=wc.run_dir,
            reader=storage.reader(),
            weight_server=self.server,
            # Awaited: a step's row is in metrics.jsonl before its checkpoint is written.
            log=lambda metrics, *, step, source: ray.get(
                hub.log.remote(metrics, step=step, source=source), timeout=LOG_TIMEOUT_S
            ),
            curriculum_state=proxy.state_dict,
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

    def starved_seconds(self) -> float:
        """See :meth:`marin_rl_core.trainer.Trainer.starved_seconds` (paced workers ask)."""
        self._check()
        return self.trainer.starved_seconds()

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


class RolloutService(_SetUpError):
    """One rollout worker process (a Ray actor), restarted by Ray when its process dies.

    It finds the job's curriculum and metrics hub by their actor names: Ray re-runs the
    constructor of a restarted actor with the same arguments, and actor handles among them
    would have to stay pinned for that (Ray says so on the console)."""

    def __init__(self, wc: WorkerConfig, storage: Any, curriculum: str, hub: str):
        self._connected = False
        self._set_up(lambda: self._build(wc, storage, curriculum, hub))

    def _build(self, wc: WorkerConfig, storage: Any, curriculum_name: str, hub_name: str) -> None:
        _worker_logging(wc.run_dir, f"rollout-{wc.index}")
        import ray

        curriculum, hub = _job_actor(curriculum_name), _job_actor(hub_name)
        # Awaited (a call still in flight is lost with a process killed right after): a
        # restart during set-up is then counted by the driver.
        ray.get(hub.worker_started.remote(wc.index, os.getpid()), timeout=LOG_TIMEOUT_S)

        logger.info(
            "rollout worker %d process %d on node %s (%s)",
            wc.index,
            os.getpid(),
            ray.get_runtime_context().get_node_id(),
            ray.util.get_node_ip_address(),
        )
        from marin_rl_core import compile_cache
        from marin_rl_core.rollout_worker import RolloutWorker

        config, registry = wc.resolve()
        compile_cache.enable(config.compilation_cache)
        self._transfer = registry.get("weight_transfer", config.weight_transfer.name).build(
            config.weight_transfer.config
        )
        self.worker = RolloutWorker(
            config,
            registry,
            worker_index=wc.index,
            writer=storage.writer(),
            weight_client=None,  # connected in run(), once the trainer's server is up
            curriculum=CurriculumProxy(curriculum),
            log=lambda metrics, *, step, source: hub.log.remote(metrics, step=step, source=source),
        )
        self.worker.warm_up()  # compiles while the trainer sets up
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

            self.worker.trainer_starved = lambda: float(
                ray.get(trainer.starved_seconds.remote(), timeout=5.0)
            )
        self._connected = True

    def stop(self) -> None:
        if self._setup_error is None:
            self.worker.request_stop()

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
        from marin_rl_core.export import trained_model
        from marin_rl_core.registry import build_registry

        return trained_model(self.run_dir, build_registry())[0]

    def export(self, out_dir: str | Path) -> Path:
        """Write the trained policy as a Hugging Face checkpoint directory (what ``marinrl
        export RUN_DIR OUT_DIR`` does); ``transformers`` loads it with ``from_pretrained``."""
        from marin_rl_core.export import export_hf
        from marin_rl_core.registry import build_registry

        return export_hf(self.run_dir, out_dir, build_registry())[0]


def _format_resources(resources: dict[str, float]) -> str:
    def one(name: str, amount: float) -> str:
        if name == "memory":
            return f"{amount / 2**30:.1f} GiB memory"
        return f"{amount:g} {name}"

    return ", ".join(one(k, v) for k, v in sorted(resources.items())) or "nothing"


def check_resources(config: RLJobConfig, nodes: list[dict[str, float]]) -> None:
    """Refuse a job whose ``[resources]`` the cluster cannot meet, before any actor starts (Ray
    would leave such an actor pending forever).

    Args:
        config: the run config.
        nodes: the resources of each live node (``ray.nodes()[i]["Resources"]``).

    Raises:
        ResourcesUnavailableError: naming what each role asks for and what the cluster has.
    """
    from marin_rl_core.errors import ResourcesUnavailableError

    cluster: dict[str, float] = {}
    for node in nodes:
        for name, amount in node.items():
            if (
                not name.startswith(("node:", "accelerator_type:"))
                and name != "object_store_memory"
            ):
                cluster[name] = cluster.get(name, 0.0) + amount
    roles = [
        ("trainer", "resources.trainer", config.resources.trainer.requested(), 1),
        (
            "each rollout worker",
            "resources.rollout",
            config.resources.rollout.requested(),
            config.num_rollout_workers,
        ),
    ]
    problems, total = [], {}
    for role, path, asked, count in roles:
        for name, amount in asked.items():
            total[name] = total.get(name, 0.0) + amount * count
        if asked and not any(
            all(node.get(k, 0.0) >= v for k, v in asked.items()) for node in nodes
        ):
            problems.append(
                f"the {role} asks for {_format_resources(asked)} ($.{path}), and no node has that"
            )
    short = {k: v for k, v in total.items() if cluster.get(k, 0.0) < v}
    if short and not problems:
        problems.append(
            f"together the trainer and {config.num_rollout_workers} rollout worker(s) ask for "
            f"{_format_resources(short)}"
        )
    if problems:
        raise ResourcesUnavailableError(
            "the Ray cluster cannot run this job: "
            + "; ".join(problems)
            + f". The cluster has {_format_resources(cluster)}"
            + (f" on {len(nodes)} nodes" if len(nodes) > 1 else "")
            + ". Lower those [resources] values (or num_rollout_workers), or run on a cluster "
            "that has them (--ray-address; `ray start --num-gpus N --resources '{\"TPU\": 4}'` "
            "adds a node's resources)."
        )


def check_model(config: RLJobConfig) -> list[str]:
    """Problems of the ``[model]`` section found without building the model: the checkpoint
    exists and is a supported architecture, its tokenizer loads and fits its vocabulary, and
    ``max_seq_len`` fits its context length. Returns error lines; raises :class:`ConfigError`
    for a checkpoint that cannot be found at all."""
    from marin_rl_core.pretrained import check_vocab, context_length, read_pretrained_info
    from marin_rl_core.tokenizer import model_tokenizer

    model = config.model
    if not model.checkpoint and model.tokenizer in ("auto", "arithmetic"):
        return []
    if model.checkpoint:
        read_pretrained_info(model.checkpoint)  # exists, and an architecture marinrl trains
    try:
        tokenizer = model_tokenizer(model)
    except ValueError as exc:
        return [f"$.model.tokenizer: {exc}"]
    if not model.checkpoint:
        return []
    check_vocab(model, tokenizer)
    errors = []
    limit = context_length(model)
    if limit is not None and model.max_seq_len > limit:
        errors.append(
            f"$.model.max_seq_len ({model.max_seq_len}) is longer than the checkpoint's context "
            f"length (max_position_embeddings = {limit}); lower it to at most {limit}"
        )
    return errors


FAIL_FAST_BATCHES = 3
"""Before the first training step, a job whose every rollout worker dropped every problem of
this many batches in a row (and wrote none) stops at once, naming the cause."""

STATE_SHAPING_MODEL_FIELDS = ("checkpoint", "tokenizer", "resize_vocab")
"""``[model]`` settings that decide what a checkpoint holds, for any model; the default model's
shape fields count too when no checkpoint is set."""
DEFAULT_MODEL_SHAPE_FIELDS = (
    "hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads",
)  # fmt: skip


def resume_conflicts(saved: RLJobConfig, new: RLJobConfig) -> list[str]:
    """Settings of ``new`` that change what the checkpoints of a run saved with ``saved`` hold
    (the model's shape, vocabulary, parameter dtype), as ``"model.hidden_dim: 64 -> 128"``: a
    resume with them could not load the run's checkpoints. Empty when they load."""
    fields = list(STATE_SHAPING_MODEL_FIELDS)
    if not saved.model.checkpoint and not new.model.checkpoint:
        fields += DEFAULT_MODEL_SHAPE_FIELDS
    out = [
        f"model.{name}: {getattr(saved.model, name)!r} -> {getattr(new.model, name)!r}"
        for name in fields
        if getattr(saved.model, name) != getattr(new.model, name)
    ]
    dtypes = [
        c.trainer.mp_policy(hf_checkpoint=bool(c.model.checkpoint)).param_dtype
        for c in (saved, new)
    ]
    if dtypes[0] != dtypes[1]:
        out.append(
            f"trainer.precision: {saved.trainer.precision!r} -> {new.trainer.precision!r} "
            f"(parameters in {dtypes[0].__name__} -> {dtypes[1].__name__})"
        )
    return out


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
        self.run_id = config.run_id or time.strftime("rl-%Y%m%d-%H%M%S")
        # Absolute, so the saved config and the printed resume command work from anywhere.
        self.run_dir = Path(config.run_dir).expanduser().absolute() / self.run_id
        self._auth_mode: Any = _UNSET
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
        if not self.config.curriculum.lessons:
            errors.append("$.curriculum.lessons: a job needs at least one lesson")
        self._check_resume()
        errors += check_model(self.config)
        if errors:
            lines = dict.fromkeys(errors)  # a run-wide setting is reported once, not per lesson
            raise ConfigError("invalid job config:\n" + "\n".join(f"  {e}" for e in lines))

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
        conflicts = resume_conflicts(saved, self.config)
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
                    f"--ray-address): {type(exc).__name__}: {_first_line(exc)}. Check that it is "
                    "a Ray head of the same Ray version (`ray status --address ADDRESS`)."
                ) from exc
            return True
        # Ray turns token authentication on for a new local cluster and sets RAY_AUTH_MODE in
        # os.environ, with a warning addressed to Ray users: keep the authentication, drop the
        # warning, and give RAY_AUTH_MODE its previous value back at shutdown so that child
        # processes do not inherit Ray's.
        self._auth_mode = os.environ.get("RAY_AUTH_MODE")
        logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
            _no_token_auth_notice
        )
        # address="local": a new instance even where `ray start` left a cluster address behind
        # (plain ray.init() would try to join that one).
        with _lean_loopback_head():
            ray.init(
                address="local",
                include_dashboard=False,
                log_to_driver=False,
                num_cpus=os.cpu_count() or 2,
            )
        address = ray.get_runtime_context().gcs_address
        if not address.startswith(("127.", "[::1]", "localhost")):
            logger.warning("the local Ray instance listens at %s, not on loopback only", address)
        return True

    def _stop_ray(self) -> None:
        import ray

        ray.shutdown()
        if self._auth_mode is not _UNSET:
            if self._auth_mode is None:
                os.environ.pop("RAY_AUTH_MODE", None)
            else:
                os.environ["RAY_AUTH_MODE"] = self._auth_mode
            self._auth_mode = _UNSET

    def _write_run_dir(self, config: RLJobConfig) -> None:
        """Create the run directory, write ``config.toml`` and open ``driver.log``: only after
        every check passed, so a bad resume leaves the saved run as it was."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if not (self.run_dir / "config.toml").exists():
                self._save_config(config)
            # A resume's config replaces the saved one only once the trainer has restored a
            # checkpoint with it (_run_actors): a resume that fails leaves the run resumable.
            self._log_handler = attach_log_file(self.driver_log)
        except OSError as exc:
            raise run_dir_error(exc, self.run_dir, resumable=False) from None

    def _save_config(self, config: RLJobConfig) -> None:
        """Write ``config.toml`` whole or not at all (a crash mid-write keeps the old one)."""
        tmp = self.run_dir / "config.toml.tmp"
        tmp.write_text(dump_config(config, self.registry))
        tmp.replace(self.run_dir / "config.toml")

    @property
    def driver_log(self) -> Path:
        return self.run_dir / "driver.log"

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
        started_ray = self._start_ray()
        # After ray.init, which installs its own SIGTERM handler (exit 1, no checkpoint).
        restore_sigterm = _handle_sigterm()
        try:
            ray_address = ray.get_runtime_context().gcs_address
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            check_resources(config, [n["Resources"] for n in nodes])
            self._write_run_dir(config)
            if on_start is not None:
                on_start()
            logger.info(
                "%s Ray cluster at %s: %d node(s) at %s",
                "started a local" if started_ray and not config.ray_address else "using the",
                ray_address,
                len(nodes),
                ", ".join(str(n.get("NodeManagerAddress")) for n in nodes),
            )
            try:
                return self._run_actors(config, ray_address, progress)
            except Exception as exc:
                raise self._user_error(exc) from None
        finally:
            restore_sigterm()
            if self._log_handler is not None:
                logging.getLogger().removeHandler(self._log_handler)
                self._log_handler.close()
                self._log_handler = None
            if started_ray:
                self._stop_ray()

    def _user_error(self, exc: BaseException) -> MarinRLError:
        """What the user is told about ``exc`` (a worker's error arrives wrapped by Ray); the
        traceback goes to ``driver.log``."""
        cause = getattr(exc, "cause", None) or exc
        if isinstance(cause, MarinRLError):
            return cause
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
            f"the job failed: {type(cause).__name__}: {_first_line(cause)}. The traceback is in "
            f"{self.driver_log} and the workers' logs in {self.run_dir / 'logs'}; the last "
            f"checkpoint is kept (resume with `{self.resume_command()}`)."
        )

    def _run_actors(self, config: RLJobConfig, ray_address: str, progress: bool) -> JobResult:
        import ray

        from marin_rl_core.metrics import MetricsHub

        trainer_wc, rollout_wcs = self.to_worker_configs()
        faults = config.faults
        actors: list[Any] = []
        storage = self.registry.get("storage", config.storage.name).build(config.storage.config)
        try:
            names = {role: f"marinrl-{self.run_id}-{os.urandom(4).hex()}-{role}" for role in
                     ("hub", "curriculum")}  # fmt: skip
            # The trainer and rollout workers first: Ray starts as many worker processes as the
            # node has CPUs as soon as the driver connects, and the first actors created get
            # them (~0.5 s sooner than a new process on a 2-core machine). The hub and the
            # curriculum follow; the workers find them by name.
            trainer = (
                ray.remote(TrainerService)
                .options(**config.resources.trainer.ray_options(), max_concurrency=4)
                .remote(trainer_wc, storage, names["curriculum"], names["hub"])
            )
            actors.append(trainer)
            # The rollout workers set up (model, sampler, envs) while the trainer does; they
            # connect to its weight server when they are handed their run.
            rollouts = [
                ray.remote(RolloutService)
                .options(
                    **config.resources.rollout.ray_options(),
                    max_concurrency=4,
                    max_restarts=faults.worker_restarts,
                    max_task_retries=0,
                )
                .remote(wc, storage, names["curriculum"], names["hub"])
                for wc in rollout_wcs
            ]
            actors += rollouts
            hub = (
                ray.remote(MetricsHub)
                .options(num_cpus=0, name=names["hub"])
                .remote(str(self.run_dir), config.logging.tracker, self.run_id)
            )
            curriculum = (
                ray.remote(CurriculumService)
                .options(num_cpus=0, name=names["curriculum"])
                .remote(trainer_wc)
            )
            actors += [hub, curriculum]
            try:
                info = ray.get(trainer.ready.remote())
            except ray.exceptions.RayActorError as exc:
                raise WorkerLostError(
                    f"the trainer process died while setting up ({_first_line(exc)}); see "
                    f"{self.run_dir / 'logs' / 'trainer.log'}"
                ) from exc
            for warning in info["warnings"]:
                logger.warning("%s", warning)
                print(f"warning: {warning}", file=sys.stderr)
            try:
                self._save_config(config)  # the checkpoint (if any) loaded with this config
            except OSError as exc:
                raise run_dir_error(exc, self.run_dir, resumable=True) from None
            # The curriculum resumes from the checkpoint the trainer restored, and the metrics
            # of steps after it (logged by the run that died) give way to the steps trained again.
            ray.get(curriculum.load_state.remote(info["curriculum"]))
            start_step = int(info["step"])
            # Each rollout worker goes on after the last batch the checkpoint received, so the
            # resumed run draws the problems the uninterrupted one would have drawn.
            positions = {int(k): int(v) for k, v in info["positions"].items()}
            # (A run resumed before its first checkpoint starts again at step 0.)
            dropped = ray.get(hub.resume_at.remote(start_step))
            if start_step or dropped:
                logger.info(
                    "resuming at step %d (%d metric rows of later steps dropped)",
                    start_step,
                    dropped,
                )
            watch = _Watch(self, trainer, rollouts, hub, start_step, info["address"], positions)
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
            ray.get(trainer.close.remote(), timeout=faults.stop_timeout_s)
            ray.get(hub.close.remote(), timeout=faults.stop_timeout_s)
        finally:
            for actor in actors:
                ray.kill(actor)
            close = getattr(storage, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # the queue actor may already be gone with Ray
                    pass
        return JobResult(
            run_dir=self.run_dir,
            final_step=final_step,
            interrupted=interrupted,
            final_eval=final_eval,
            rollout_counters=counters,
            ray_address=ray_address,
        )


class _Watch:
    """The driver's view of a running job: progress bar, watchdog, rollout worker restarts and
    bounded stops. Every wait here has a timeout; a dead actor is an error, never a hang."""

    def __init__(
        self,
        job: RLJob,
        trainer: Any,
        rollouts: list[Any],
        hub: Any,
        start: int,
        address: str,
        positions: dict[int, int],
    ):
        self.job, self.trainer, self.rollouts, self.hub = job, trainer, rollouts, hub
        self.faults = job.config.faults
        self.start = self.step = start
        self.train_run = trainer.run.remote()
        # A worker's run connects it to the trainer's weight server, starts it at the batch
        # after the last one the restored checkpoint received, and lets it ask the trainer
        # whether it is short of rollouts (pacing).
        self.run_args = [(address, positions.get(i, 0), trainer) for i in range(len(rollouts))]
        self.runs: dict[int, Any] = {
            i: w.run.remote(*self.run_args[i]) for i, w in enumerate(rollouts)
        }
        self.restarts = [0] * len(rollouts)
        self.due: dict[int, float] = {}  # worker index -> when to hand a restarted worker its run
        # Each worker's process id: a new one after a failed run is a restart (Ray restarts a
        # dead actor itself; a run may also fail while it is being restarted).
        self.pids: list[int | None] = [None] * len(rollouts)
        self.pid_refs: dict[int, Any] = {i: w.process.remote() for i, w in enumerate(rollouts)}
        self.counters: list[dict[str, Any]] = [{} for _ in rollouts]
        # The trainer's own step, asked once a second: train rows reach the metrics hub only
        # every logging.log_every steps, and a slow real-model step times log_every can exceed
        # faults.stall_timeout_s in a healthy job.
        self.step_ref: Any = trainer.step.remote()

    def _trainer_step(self) -> int | None:
        """The trainer's step if its last answer has come (then asks again), else ``None``."""
        import ray

        if not ray.wait([self.step_ref], timeout=0)[0]:
            return None
        try:
            step = int(ray.get(self.step_ref))
        except Exception:  # noqa: BLE001 - a dead trainer is reported by its run's result
            return None
        self.step_ref = self.trainer.step.remote()
        return step

    # --- while training -----------------------------------------------------------------------

    def run(self, progress: bool) -> int:
        """Wait for the trainer to finish, driving the progress bar; returns its final step."""
        import ray
        from tqdm import tqdm

        total = self.job.config.trainer.num_train_steps
        bar = tqdm(
            total=total,
            initial=self.start,
            desc="train",
            unit="step",
            disable=not progress,
            dynamic_ncols=True,
        )
        last_progress = next_look = time.monotonic()
        try:
            while True:
                refs = [self.train_run, *self.runs.values()]
                done, _ = ray.wait(refs, num_returns=1, timeout=1.0)
                latest = ray.get(self.hub.latest.remote(), timeout=60)
                if "write_error" in latest:  # metrics.jsonl cannot be written: stop, with why
                    failed = latest["write_error"]
                    raise run_dir_error(
                        OSError(failed["errno"], failed["strerror"], failed["path"]),
                        self.job.run_dir,
                        resumable=True,
                    )
                step = max(int(latest.get("train_step", self.start)), self._trainer_step() or 0)
                if step > self.step:
                    self.step, last_progress = step, time.monotonic()
                bar.update(max(0, step - bar.n))
                bar.set_postfix(_postfix(latest), refresh=False)
                for ref in done:
                    if ref is self.train_run:
                        final = self._trainer_result()
                        bar.update(max(0, final - bar.n))
                        return final
                    self._rollout_ended(next(i for i, r in self.runs.items() if r is ref))
                self._check_processes()
                self._hand_out_restarts()
                stalled = time.monotonic() - last_progress
                if self.faults.stall_timeout_s and stalled > self.faults.stall_timeout_s:
                    raise StalledError(self.stall_report(stalled))
                if self.step == self.start and time.monotonic() >= next_look:
                    next_look = time.monotonic() + 2.0
                    if self._nothing_can_succeed():
                        raise StalledError(self.stall_report(stalled, first_batches=True))
        finally:
            bar.close()

    def _trainer_result(self) -> int:
        import ray

        try:
            return int(ray.get(self.train_run))
        except ray.exceptions.RayActorError as exc:
            raise WorkerLostError(
                f"the trainer process died at step {self.step} ({_first_line(exc)}). Its last "
                f"checkpoint is kept; resume with `{self.job.resume_command()}`. Its log: "
                f"{self.job.run_dir / 'logs' / 'trainer.log'}"
            ) from None

    def _rollout_ended(self, i: int) -> None:
        """Rollout worker ``i``'s run ended before training did. Its actor died or is being
        restarted: ask for its process (answered once Ray has it back); its own error: raise."""
        import ray

        ref = self.runs.pop(i)
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            logger.warning("rollout worker %d's run failed: %s", i, _first_line(exc))
            self.pid_refs[i] = self.rollouts[i].process.remote()
            return
        except Exception:
            # A worker that lost the trainer (its weight server gone) fails too: the trainer's
            # death, not the worker's symptom of it, is what the user must hear about.
            if ray.wait([self.train_run], timeout=10)[0]:
                self._trainer_result()
            raise
        log = self.job.run_dir / "logs" / f"rollout-{i}.log"
        raise MarinRLError(
            f"rollout worker {i} stopped before training finished; see {log}"
        )  # a normal return before stop(): should not happen

    def _check_processes(self) -> None:
        """Match each worker's answered process id with the last one: a new process is a
        restart (counted, logged, bounded by ``faults.worker_restarts``), and a worker whose
        run failed gets its run again after the backoff."""
        import ray

        if not self.pid_refs:
            return
        refs = list(self.pid_refs.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for i, ref in list(self.pid_refs.items()):
            if ref not in ready:
                continue
            del self.pid_refs[i]
            log = self.job.run_dir / "logs" / f"rollout-{i}.log"
            try:
                pid = int(ray.get(ref))
            except ray.exceptions.ActorUnavailableError:
                self.pid_refs[i] = self.rollouts[i].process.remote()  # still restarting
                continue
            except ray.exceptions.RayActorError as exc:
                died = max(self.restarts[i] + 1, len(self._processes(i)))
                raise WorkerLostError(
                    f"rollout worker {i} died {died} times, more than "
                    f"faults.worker_restarts = {self.faults.worker_restarts} restarts allow "
                    f"({_first_line(exc)}). The job stopped with a checkpoint; see {log}, then "
                    f"resume with `{self.job.resume_command()}`."
                ) from None
            previous, self.pids[i] = self.pids[i], pid
            if previous is None:
                # The first answer: the run handed out at the start waited for Ray's restarts
                # of a worker whose process died while setting up; count and log them.
                for dead in (p for p in self._processes(i) if p != pid):
                    self._restarted(i, dead, pid, "while setting up")
            if i in self.runs:
                continue  # a worker that is running
            delay = 0.0
            if previous is not None and pid != previous:
                delay = self._restarted(i, previous, pid)
            self.due[i] = time.monotonic() + delay

    def _processes(self, i: int) -> list[int]:
        """The processes rollout worker ``i`` has had (as they told the metrics hub)."""
        import ray

        try:
            return list(ray.get(self.hub.worker_processes.remote(i), timeout=10))
        except Exception:  # noqa: BLE001 - the count is for the message and the metric only
            return []

    def _restarted(self, i: int, dead: int, pid: int, when: str = "") -> float:
        """Count, log and record rollout worker ``i``'s restart; returns the backoff before
        its work is handed back."""
        self.restarts[i] += 1
        delay = self.faults.restart_backoff_s * 2 ** (self.restarts[i] - 1)
        logger.warning(
            "rollout worker %d died%s (process %d); restart %d of %d (process %d)%s",
            i,
            f" {when}" if when else "",
            dead,
            self.restarts[i],
            self.faults.worker_restarts,
            pid,
            "" if when else f", its work handed back in {delay:.1f} s",
        )
        self.hub.log.remote(
            {"faults/rollout_worker_restarts": float(sum(self.restarts))},
            step=self.step,
            source="faults",
        )
        return delay

    def _hand_out_restarts(self) -> None:
        now = time.monotonic()
        for i, when in list(self.due.items()):
            if now >= when:
                del self.due[i]
                # Waits for Ray's restart.
                self.runs[i] = self.rollouts[i].run.remote(*self.run_args[i])

    def _nothing_can_succeed(self) -> bool:
        """Before the first step: every rollout worker has dropped every problem of its first
        :data:`FAIL_FAST_BATCHES` batches (prompts too long, the env raising or timing out on
        each) and written none. Nothing suggests the next batches would differ, so the job
        stops now rather than after ``faults.stall_timeout_s``."""
        import ray

        try:
            counters = ray.get([w.counters.remote() for w in self.rollouts], timeout=5)
        except Exception:  # noqa: BLE001 - a worker busy restarting: look again later
            return False
        return all(
            c.get("batches_written", 0) == 0
            and c.get("recent_empty_batches", 0) >= FAIL_FAST_BATCHES
            for c in counters
        )

    def stall_report(self, stalled: float, *, first_batches: bool = False) -> str:
        """Why no step completed: the trainer's stage and the rollout side's counters."""
        import ray

        config = self.job.config
        lines = [
            f"every problem of the first {FAIL_FAST_BATCHES} batches of each rollout worker was "
            f"dropped, so no training step can run; the job stopped at step {self.step}."
            if first_batches
            else f"no training step completed for {stalled:.0f} s (faults.stall_timeout_s = "
            f"{config.faults.stall_timeout_s:g}); the job stopped at step {self.step} with a "
            f"checkpoint."
        ]
        try:
            diag = ray.get(self.trainer.diagnostics.remote(), timeout=30)
            lines.append(
                f"  trainer: {diag['stage']} for {diag['stage_seconds']:.0f} s; it has read "
                f"{diag['rollouts_read']} rollouts, {diag['rollouts_in_buffer']} wait in the "
                f"replay buffer, {diag['dropped_stale']} were dropped as stale"
            )
        except Exception as exc:  # noqa: BLE001 - a report, not a control path
            diag = {}
            lines.append(f"  trainer: no answer ({type(exc).__name__})")
        totals: dict[str, int] = {}
        for i, w in enumerate(self.rollouts):
            try:
                self.counters[i] = ray.get(w.counters.remote(), timeout=30)
            except Exception:  # noqa: BLE001
                continue
            for k, v in self.counters[i].items():
                if isinstance(v, int) and k != "weight_step":
                    totals[k] = totals.get(k, 0) + v
        last_error = next(
            (c["last_env_error"] for c in self.counters if c and c.get("last_env_error")), ""
        )
        limit = config.model.max_seq_len - 1
        lines.append(
            f"  rollout workers: {totals.get('batches_sampled', 0)} batches sampled, "
            f"{totals.get('batches_written', 0)} written to storage; "
            f"{totals.get('prompts_too_long', 0)} prompts dropped as longer than {limit} tokens, "
            f"{totals.get('env_errors', 0)} problems dropped for env errors, "
            f"{totals.get('env_timeouts', 0)} episodes cut off by env timeouts, "
            f"{totals.get('write_errors', 0)} storage write errors (retried)"
        )
        recent = totals.get("recent_empty_batches", 0)
        if totals.get("batches_sampled", 0) == 0:
            cause = (
                "the rollout workers have not finished a batch: they may still be compiling, or "
                "be stuck; their logs say which"
            )
        elif recent and totals.get("prompts_too_long", 0):
            cause = (
                f"the last {recent} batches were all dropped: prompts longer than {limit} tokens "
                f"(model.max_seq_len = {config.model.max_seq_len}). Raise model.max_seq_len or "
                "give the env shorter prompts"
            )
        elif recent and totals.get("env_errors", 0):
            cause = (
                f"the last {recent} batches were all dropped: the env failed on every problem "
                f"(latest: {last_error or 'see the logs'}; the first error of each lesson, with "
                "its traceback, is in the rollout workers' logs)"
            )
        elif recent and totals.get("env_timeouts", 0):
            cause = (
                f"the last {recent} batches were all dropped: the env's calls timed out "
                f"(episodes.step_timeout_s = {config.episodes.step_timeout_s:g}, "
                f"episode_timeout_s = {config.episodes.episode_timeout_s:g}; latest: "
                f"{last_error or 'see the logs'}). Fix the env's hanging call, or raise the "
                "timeouts if it is only slow"
            )
        elif totals.get("write_errors", 0) and not totals.get("batches_written", 0):
            cause = (
                f"writing to rollout storage keeps failing ({totals['write_errors']} errors, "
                "retried with backoff): the rollout workers' logs name the error"
            )
        elif diag.get("dropped_stale"):
            cause = (
                "rollouts arrive too stale for the trainer: raise "
                "replay_buffer.max_rollout_step_delay or lower trainer.sync_interval_steps"
            )
        elif diag.get("stage") == "in a training step":
            cause = "the training step itself is slow or stuck; see the trainer's log"
        else:
            cause = "the logs say more"
        lines.append(f"  likely cause: {cause}.")
        lines.append(f"  logs: {self.job.run_dir / 'logs'}")
        lines.append(f"  once fixed, resume with `{self.job.resume_command()}`")
        return "\n".join(lines)

    # --- stopping -----------------------------------------------------------------------------

    def stop_trainer(self) -> int:
        """Ask the trainer to checkpoint and stop; wait at most ``faults.stop_timeout_s``."""
        import ray

        timeout = self.faults.stop_timeout_s
        try:
            ray.get(self.trainer.stop.remote(), timeout=timeout)
            return int(ray.get(self.train_run, timeout=timeout))
        except ray.exceptions.GetTimeoutError:
            logger.error("the trainer did not stop within %.0f s (faults.stop_timeout_s)", timeout)
        except Exception as exc:  # noqa: BLE001 - already stopping for another reason
            logger.warning("the trainer could not stop cleanly: %s", _first_line(exc))
        return self.step

    def stop_rollouts(self) -> list[dict[str, Any]]:
        """Stop every rollout worker; their counters (``{}`` for one that did not answer)."""
        import ray

        for w in self.rollouts:
            w.stop.remote()
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + self.faults.stop_timeout_s
        for i in range(len(self.rollouts)):
            ref = self.runs.get(i)
            try:
                if ref is None:
                    raise ValueError("not running")
                out.append(ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1)))
            except Exception as exc:  # noqa: BLE001 - a dead or stuck worker at the end
                logger.warning("rollout worker %d did not stop cleanly: %s", i, _first_line(exc))
                out.append(self.counters[i])
        return out

    def final_eval(self, step: int) -> dict[str, Any]:
        """Worker 0's eval of the final weights; ``{}`` (with a warning) if it cannot: the
        worker is gone, never gets those weights, or takes longer than
        ``faults.stall_timeout_s`` (an hour with the watchdog off)."""
        import ray

        timeout = self.faults.stall_timeout_s or 3600.0
        address = self.run_args[0][0]
        deadline = time.monotonic() + timeout
        try:
            while True:
                ref = self.rollouts[0].final_eval.remote(step, address, timeout)
                try:
                    return ray.get(ref, timeout=max(deadline - time.monotonic(), 1.0) + 60)
                except ray.exceptions.ActorUnavailableError:
                    # Being restarted after its process died: its constructor will finish.
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
        except ray.exceptions.GetTimeoutError:
            logger.warning(
                "no final eval: rollout worker 0 did not finish it within %.0f s "
                "(faults.stall_timeout_s); `marinrl eval %s` scores the final checkpoint",
                timeout,
                self.job.run_dir,
            )
        except Exception as exc:  # noqa: BLE001 - the run is trained; only its eval is missing
            logger.warning(
                "no final eval (%s); `marinrl eval %s` scores the final checkpoint",
                _first_line(exc),
                self.job.run_dir,
            )
        return {}


class Terminated(KeyboardInterrupt):
    """SIGTERM (what schedulers and preemption send), handled like Ctrl-C: the trainer writes
    a checkpoint and the job ends with exit code 130."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def _handle_sigterm() -> Any:
    """Turn SIGTERM into :class:`Terminated` in the main thread; returns the undo."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    return lambda: signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _lean_loopback_head() -> Iterator[None]:
    """Settings of Ray for the job's own local instance, for one ``ray.init`` (put back after).

    * Ray's single-machine mode (its default on macOS and Windows) puts the node on 127.0.0.1,
      so every server of this instance listens on loopback only; Ray reads the switch
      (``ray_constants.ENABLE_RAY_CLUSTER``) when it picks the node's address.
    * No HTTP API server, no autoscaler monitor and no log monitor: one node that never scales,
      no dashboard (``include_dashboard=False`` still starts the API server, for usage
      statistics only) and no job or state API clients need the first two, and the log monitor
      only copies workers' output to drivers that ask for it (``log_to_driver``), which the
      job's driver does not (each worker logs to ``run_dir/logs``). ``ray.init`` waits for the
      first two one after the other, and the log monitor's start competes for the CPU with the
      raylet's: together ~4 s of the job's start-up on a 2-core machine (issue 11). Ray has no
      public switch for them, so the three methods of Ray's ``Node`` that start them are
      skipped; where a Ray version lacks one, Ray starts that process as usual. Want the
      dashboard? Start a cluster with ``ray start --head --include-dashboard=true`` and pass
      ``--ray-address``.
    * Ray's processes (GCS, raylet, and the workers the raylet starts) run in a session of
      their own, as Ray already keeps SIGINT from them: a scheduler's SIGTERM to the job's
      whole process group (Slurm's ``scancel``, Kubernetes) reaches the driver alone, which
      stops the trainer with a final checkpoint and then shuts Ray down. They still die with
      the driver (Ray's fate sharing).
    """
    from ray._private import node, ray_constants, services

    # (owner, attribute, value while the job's ray.init runs); each is put back after.
    patches: list[tuple[Any, str, Any]] = [(ray_constants, "ENABLE_RAY_CLUSTER", False)]
    patches += [
        (node.Node, name, _skip_head_process)
        for name in ("start_api_server", "start_monitor", "start_log_monitor")
        if name in node.Node.__dict__
    ]
    if sys.platform != "win32":
        own_session = functools.partial(services.ConsolePopen, start_new_session=True)
        patches.append((services, "ConsolePopen", own_session))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _skip_head_process(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


def _no_token_auth_notice(record: logging.LogRecord) -> bool:
    return "Token authentication is enabled for this Ray cluster" not in record.getMessage()


def _postfix(latest: dict[str, Any]) -> dict[str, str]:
    postfix = {}
    if "reward" in latest:
        postfix["reward"] = f"{latest['reward']:.3f}"
    evals = {
        k.split("/")[1]: v
        for k, v in latest.items()
        if k.startswith("eval/") and k.endswith("/reward")
    }
    if evals:
        postfix["eval"] = " ".join(f"{k}={v:.2f}" for k, v in evals.items())
    turns = latest.get("rollout/turns")
    if isinstance(turns, int | float) and turns > 1:  # multi-turn episodes: how long they run
        postfix["turns"] = f"{turns:.1f}"
        postfix["env_step"] = f"{latest.get('rollout/env_step_seconds', 0.0):.3f}s"
    for key in ("env_errors", "env_timeouts", "prompts_too_long"):  # of the latest batch
        value = latest.get(f"rollout/{key}")
        if isinstance(value, int | float) and value > 0:
            postfix[key] = f"{value:.0f}"
    return postfix


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


RUN_DIR_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.ENOTDIR,
    errno.EEXIST,
}


def run_dir_error(exc: OSError, run_dir: Path, *, resumable: bool) -> RunDirError:
    """A :class:`RunDirError` for an ``OSError`` writing the run directory, with the fix."""
    what = exc.filename or run_dir
    fixes = {
        errno.ENOSPC: "free some space there",
        errno.EDQUOT: "free some space there",
        errno.EROFS: "choose a writable run_dir",
        errno.EACCES: "choose a run_dir you may write to",
        errno.EPERM: "choose a run_dir you may write to",
        errno.ENOTDIR: "a file is in the way: choose another run_dir",
        errno.EEXIST: "a file is in the way: choose another run_dir",
    }
    fix = fixes.get(exc.errno or 0, "check the run directory")
    resume = f", then resume with `marinrl run --resume {run_dir}`" if resumable else ""
    return RunDirError(f"cannot write {what}: {exc.strerror or exc}; {fix}{resume}")


def probe_ray_address(address: str, *, timeout: float = 5.0) -> None:
    """Raise :class:`ClusterError` unless something accepts connections at ``address``
    (``HOST:PORT``, ``ray://HOST:PORT``; ``auto`` is left to Ray). A wrong address would
    otherwise have Ray retry for minutes."""
    import socket

    if address == "auto":
        return
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterError(
            f"--ray-address {address!r} is not HOST:PORT (the address `ray start --head` prints, "
            "for example 127.0.0.1:6379)"
        )
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        if isinstance(exc, TimeoutError | socket.timeout):
            reason = f"no answer within {timeout:g} s"
        raise ClusterError(
            f"nothing answers at {address} (--ray-address / $.ray_address): {reason}. Start the "
            f"cluster's head there (`ray start --head --port {port}`), correct the address, or "
            "leave --ray-address out to start a local Ray."
        ) from None
