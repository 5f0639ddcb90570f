"""``RLJob``: one trainer and N rollout workers as Ray actors, from one :class:`RLJobConfig`.

The driver (``marinrl run`` or ``RLJob(config, registry).run()``):

1. validates the config and creates the run directory (``config.toml`` is written there);
2. starts Ray (a local instance, or ``ray_address``) and the shared actors: the metrics hub and
   the curriculum (restored from the newest checkpoint when the run directory has one);
3. starts the trainer actor and waits until it is ready (weights built, weight server up);
4. starts the rollout workers, pointed at the trainer's weight server and the rollout storage;
5. shows a progress bar until the trainer reaches ``num_train_steps``, then stops the rollout
   workers, has worker 0 evaluate the final weights, writes the summary and the reward plot,
   and returns the trained model read back from the final checkpoint.

Every worker gets the config as plain data plus the driver's :class:`RegistrySpec`; it rebuilds
the registry and refuses to start if its plugins differ from the driver's.
Ctrl-C stops the trainer, which writes a checkpoint; ``marinrl run --run-id SAME`` resumes.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import attrs

from marin_rl_core.config import RLJobConfig, dump_config, resolve_config, unstructure_config
from marin_rl_core.errors import ConfigError, MarinRLError
from marin_rl_core.registry import Registry, RegistrySpec, registry_from_spec

logger = logging.getLogger(__name__)


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


def _worker_logging(run_dir: str, name: str) -> None:
    """Each worker logs to ``RUN_DIR/logs/NAME.log`` (the driver's console keeps the progress bar)."""
    path = Path(run_dir) / "logs"
    path.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path / f"{name}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    for chatty in ("levanter", "jax", "datasets", "absl"):
        logging.getLogger(chatty).setLevel(logging.WARNING)


class CurriculumService:
    """The job's one curriculum policy, shared by all rollout workers (a Ray actor)."""

    def __init__(self, wc: WorkerConfig, state: dict[str, Any] | None):
        config, registry = wc.resolve()
        record = registry.get("curriculum", config.curriculum.name)
        self.policy = record.build(config.curriculum.config, config.curriculum.lessons)
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
        raise NotImplementedError("the job restores curriculum state when it creates the service")


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


class TrainerService(_SetUpError):
    """The trainer process (a Ray actor). ``ready()`` returns once its weight server is up."""

    def __init__(self, wc: WorkerConfig, storage: Any, curriculum: Any, hub: Any):
        self._set_up(lambda: self._build(wc, storage, curriculum, hub))

    def _build(self, wc: WorkerConfig, storage: Any, curriculum: Any, hub: Any) -> None:
        _worker_logging(wc.run_dir, "trainer")
        from marin_rl_core.trainer import Trainer

        config, registry = wc.resolve()
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
            log=lambda metrics, *, step, source: hub.log.remote(metrics, step=step, source=source),
            curriculum_state=proxy.state_dict,
        )

    def ready(self) -> dict[str, Any]:
        self._check()
        return {"address": self.server.address, "step": self.trainer.step}

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
    """One rollout worker process (a Ray actor)."""

    def __init__(self, wc: WorkerConfig, storage: Any, address: str, curriculum: Any, hub: Any):
        self._set_up(lambda: self._build(wc, storage, address, curriculum, hub))

    def _build(
        self, wc: WorkerConfig, storage: Any, address: str, curriculum: Any, hub: Any
    ) -> None:
        _worker_logging(wc.run_dir, f"rollout-{wc.index}")
        from marin_rl_core.rollout_worker import RolloutWorker

        config, registry = wc.resolve()
        transfer = registry.get("weight_transfer", config.weight_transfer.name).build(
            config.weight_transfer.config
        )
        self.worker = RolloutWorker(
            config,
            registry,
            worker_index=wc.index,
            writer=storage.writer(),
            weight_client=transfer.client(address),
            curriculum=CurriculumProxy(curriculum),
            log=lambda metrics, *, step, source: hub.log.remote(metrics, step=step, source=source),
        )

    def run(self) -> dict[str, int]:
        self._check()
        return self.worker.run()

    def stop(self) -> None:
        if self._setup_error is None:
            self.worker.request_stop()

    def final_eval(self, step: int) -> dict[str, float]:
        self._check()
        return self.worker.final_eval(step)

    def counters(self) -> dict[str, int]:
        self._check()
        return self.worker.counters()


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
        self.run_dir = Path(config.run_dir) / self.run_id
        self.validate()

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
        if self.config.eval.sampling.max_tokens >= max_seq:
            errors.append(f"$.eval.sampling.max_tokens must be < $.model.max_seq_len ({max_seq})")
        if not self.config.curriculum.lessons:
            errors.append("$.curriculum.lessons: a job needs at least one lesson")
        errors += check_model(self.config)
        if errors:
            raise ConfigError("invalid job config:\n" + "\n".join(f"  {e}" for e in errors))

    def to_worker_configs(self) -> tuple[WorkerConfig, list[WorkerConfig]]:
        """``(trainer, [rollout worker, ...])`` configs, exactly as the actors receive them."""
        data = unstructure_config(attrs.evolve(self.config, run_id=self.run_id), self.registry)
        spec = self.registry.spec

        def make(role: str, index: int) -> WorkerConfig:
            return WorkerConfig(
                role=role, index=index, run_dir=str(self.run_dir), config=data, registry=spec
            )

        return make("trainer", 0), [
            make("rollout", i) for i in range(self.config.num_rollout_workers)
        ]

    def _start_ray(self) -> bool:
        import ray

        if ray.is_initialized():
            return False
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        if self.config.ray_address:
            ray.init(address=self.config.ray_address, log_to_driver=False)
        else:
            # address="local": a new instance even where `ray start` left a cluster address
            # behind (plain ray.init() would try to join that one).
            ray.init(
                address="local",
                include_dashboard=False,
                log_to_driver=False,
                num_cpus=os.cpu_count() or 2,
            )
        return True

    def run(self, *, progress: bool = True) -> JobResult:
        """Train to ``num_train_steps`` (or Ctrl-C); see the module docstring."""
        import ray

        from marin_rl_core.checkpoint import latest_checkpoint
        from marin_rl_core.metrics import MetricsHub

        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = attrs.evolve(self.config, run_id=self.run_id)
        (self.run_dir / "config.toml").write_text(dump_config(config, self.registry))
        trainer_wc, rollout_wcs = self.to_worker_configs()
        resume_state: dict[str, Any] = {}
        checkpoint = latest_checkpoint(self.run_dir)
        if checkpoint is not None:
            import json

            resume_state = json.loads((checkpoint / "state.json").read_text())
        started_ray = self._start_ray()
        ray_address = ray.get_runtime_context().gcs_address
        logger.info(
            "%s Ray cluster at %s",
            "started a local" if started_ray and not config.ray_address else "using the",
            ray_address,
        )
        actors: list[Any] = []
        interrupted = False
        try:
            check_resources(config, [n["Resources"] for n in ray.nodes() if n.get("Alive")])
        except MarinRLError:
            if started_ray:
                ray.shutdown()
            raise
        storage = self.registry.get("storage", config.storage.name).build(config.storage.config)
        try:
            hub = (
                ray.remote(MetricsHub)
                .options(num_cpus=0)
                .remote(str(self.run_dir), config.logging.tracker, self.run_id)
            )
            curriculum = (
                ray.remote(CurriculumService)
                .options(num_cpus=0)
                .remote(trainer_wc, resume_state.get("curriculum"))
            )
            trainer = (
                ray.remote(TrainerService)
                .options(**config.resources.trainer.ray_options(), max_concurrency=4)
                .remote(trainer_wc, storage, curriculum, hub)
            )
            actors += [hub, curriculum, trainer]
            info = ray.get(trainer.ready.remote())
            start_step = int(info["step"])
            rollouts = [
                ray.remote(RolloutService)
                .options(**config.resources.rollout.ray_options(), max_concurrency=4)
                .remote(wc, storage, info["address"], curriculum, hub)
                for wc in rollout_wcs
            ]
            actors += rollouts
            rollout_runs = [w.run.remote() for w in rollouts]
            train_run = trainer.run.remote()
            try:
                final_step = self._watch(train_run, rollout_runs, hub, start_step, progress)
            except KeyboardInterrupt:
                interrupted = True
                logger.warning("interrupted: stopping the trainer, which writes a checkpoint")
                ray.get(trainer.stop.remote())
                final_step = ray.get(train_run)
            for w in rollouts:
                w.stop.remote()
            counters = ray.get(rollout_runs)
            final_eval = {} if interrupted else ray.get(rollouts[0].final_eval.remote(final_step))
            ray.get(trainer.close.remote())
            ray.get(hub.close.remote())
        finally:
            for actor in actors:
                ray.kill(actor)
            close = getattr(storage, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # the queue actor may already be gone with Ray
                    pass
            if started_ray:
                ray.shutdown()
        return JobResult(
            run_dir=self.run_dir,
            final_step=final_step,
            interrupted=interrupted,
            final_eval=final_eval,
            rollout_counters=counters,
            ray_address=ray_address,
        )

    def _watch(
        self, train_run: Any, rollout_runs: list[Any], hub: Any, start: int, progress: bool
    ) -> int:
        """Wait for the trainer, failing fast if any worker dies; drive the progress bar."""
        import ray
        from tqdm import tqdm

        total = self.config.trainer.num_train_steps
        bar = tqdm(
            total=total,
            initial=start,
            desc="train",
            unit="step",
            disable=not progress,
            dynamic_ncols=True,
        )
        try:
            while True:
                done, _ = ray.wait([train_run, *rollout_runs], num_returns=1, timeout=1.0)
                latest = ray.get(hub.latest.remote())
                step = int(latest.get("train_step", start))
                bar.update(max(0, step - bar.n))
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
                bar.set_postfix(postfix, refresh=False)
                if not done:
                    continue
                if done[0] is train_run:
                    final = int(ray.get(train_run))
                    bar.update(max(0, final - bar.n))
                    return final
                ray.get(done[0])  # a rollout worker ended early: re-raise its error
                raise MarinRLError(
                    "a rollout worker stopped before training finished; see RUN_DIR/logs"
                )
        finally:
            bar.close()
