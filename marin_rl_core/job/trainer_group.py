"""A trainer over several hosts in a Ray job (``resources.trainer_hosts`` > 1).

The driver places one bundle of ``resources.trainer`` per host in a Ray placement group (``SPREAD``:
on distinct nodes where the cluster has them), refusing within :data:`PLACE_TIMEOUT_S` a group
the cluster cannot place. Process 0 is the job's :class:`~marin_rl_core.job.actors.TrainerService`
(it reads rollouts, logs, serves weights, answers the driver); every other host runs a
:class:`TrainerFollower`, which takes each collective step process 0 commands
(:mod:`marin_rl_core.learner.group`). They join with ``jax.distributed`` at process 0's node, on a
port free there, before anything touches their devices.

A host that dies takes the group with it (a step needs every host's shards): the driver sees
the follower's actor die, stops the job with ``WORKER_LOST`` (exit 13) naming the host, and
``marinrl run --resume`` goes on from the last checkpoint (no final one can be written without
the host). See docs/scaling.md.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from marin_rl_core.config.schema import RLJobConfig
from marin_rl_core.errors import ResourcesUnavailableError
from marin_rl_core.job.actors import WorkerConfig, _SetUpError, _worker_logging
from marin_rl_core.rundir import is_remote, upload_now

logger = logging.getLogger(__name__)

PLACE_TIMEOUT_S = 120.0
"""How long the driver waits for Ray to place the trainer's hosts before it gives up."""


def _bundle(config: RLJobConfig) -> dict[str, float]:
    # A bundle must ask for something; a trainer that asks for nothing (one machine) gets a
    # sliver of a CPU, which its actor (0 CPUs) fits in.
    return config.resources.trainer.requested() or {"CPU": 0.01}


def place_trainer_hosts(config: RLJobConfig) -> Any:
    """A ready placement group of one bundle per trainer host.

    Raises:
        ResourcesUnavailableError: Ray did not place it within :data:`PLACE_TIMEOUT_S` (the
            cluster's free resources are named: other jobs may hold them).
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    hosts = config.resources.trainer_hosts
    group = placement_group([_bundle(config)] * hosts, strategy="SPREAD")
    try:
        ray.get(group.ready(), timeout=PLACE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        free = {k: round(v, 2) for k, v in ray.available_resources().items()
                if not k.startswith(("node:", "object_store"))}  # fmt: skip
        raise ResourcesUnavailableError(
            f"the Ray cluster did not place the trainer's {hosts} hosts, each asking for "
            f"{_bundle(config)} ($.resources.trainer), within {PLACE_TIMEOUT_S:.0f} s; free now: "
            f"{free}. Free those resources (another job may hold them), lower "
            "resources.trainer_hosts, or add nodes to the cluster."
        ) from None
    logger.info("placed the trainer's %d hosts: %s each", hosts, _bundle(config))
    return group


def on_host(group: Any, index: int) -> dict[str, Any]:
    """The ``.options(...)`` that put an actor or task on trainer host ``index`` of ``group``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=index
        )
    }


def _free_address() -> str:
    """``ip:port`` of this node with a port nothing listens on now (runs on trainer host 0)."""
    import socket

    import ray

    ip = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as sock:
        sock.bind((ip, 0))
        port = sock.getsockname()[1]
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def coordinator_address(group: Any) -> str:
    """Where the trainer's processes meet: a free port on the node of host 0 (which serves
    ``jax.distributed``'s coordination service there)."""
    import ray

    task = ray.remote(_free_address).options(num_cpus=0, **on_host(group, 0))
    return ray.get(task.remote(), timeout=60)


class TrainerFollower(_SetUpError):
    """Trainer host ``wc.index`` (> 0) of a group (a Ray actor): joins process 0 at
    ``coordinator`` and takes each collective step it commands, on its own devices' shards."""

    def __init__(self, wc: WorkerConfig, coordinator: str, hosts: int):
        self._set_up(lambda: self._build(wc, coordinator, hosts))

    def _build(self, wc: WorkerConfig, coordinator: str, hosts: int) -> None:
        _worker_logging(wc.run_dir, f"trainer-{wc.index}")
        import ray

        logger.info(
            "trainer host %d of %d: process %d on node %s (%s)",
            wc.index, hosts, os.getpid(), ray.get_runtime_context().get_node_id(),
            ray.util.get_node_ip_address(),
        )  # fmt: skip
        from marin_rl_core.learner import multihost

        multihost.join(coordinator, hosts, wc.index)
        from marin_rl_core.job import compile_cache
        from marin_rl_core.learner.trainer import Trainer

        config, registry = wc.resolve()
        compile_cache.enable(config.compilation_cache)
        self.trainer = Trainer(config, registry, run_dir=wc.run_dir, storage=None)

    def ready(self) -> int:
        """The step it restored (the same as process 0's)."""
        self._check()
        return self.trainer.step

    def run(self) -> int:
        self._check()
        try:
            return self.trainer.follow()
        finally:
            logger.info("trainer host stopped at step %d", self.trainer.step)

    def process(self) -> int:
        return os.getpid()

    def close(self) -> None:
        upload_now()  # a run directory on a bucket: the log as far as here


def start_trainer(
    config: RLJobConfig,
    wc: WorkerConfig,
    storage: Any,
    hub: str,
    rollout_wc: WorkerConfig | None = None,
) -> tuple[Any, list[Any], Any]:
    """The trainer's actors: ``(process 0, [follower, ...], placement group or None)``; one
    plain actor for one host, which also runs rollout worker 0 (``rollout_wc``) in a colocated
    job (:mod:`marin_rl_core.job.colocated`)."""
    import attrs
    import ray

    from marin_rl_core.job.actors import TrainerService

    options = {**config.resources.trainer.ray_options(), "max_concurrency": 4}
    hosts = config.resources.trainer_hosts
    if rollout_wc is not None:
        from marin_rl_core.job.colocated import ColocatedService

        options["max_concurrency"] = 8  # the trainer's and the worker's runs, and their calls
        colocated = ray.remote(ColocatedService).options(**options)
        return colocated.remote(wc, rollout_wc, storage, hub), [], None
    if hosts == 1:
        trainer = ray.remote(TrainerService).options(**options).remote(wc, storage, hub)
        return trainer, [], None
    group = place_trainer_hosts(config)
    nodes = set(ray.util.placement_group_table(group)["bundles_to_node_id"].values())
    if len(nodes) > 1 and not is_remote(wc.run_dir):
        logger.warning(
            "the trainer's hosts are on %d nodes and each writes its checkpoint shards under %s: "
            "it must be a file system they all share (or a bucket: run_dir=gs://...), or the "
            "checkpoints will be incomplete", len(nodes), wc.run_dir,
        )  # fmt: skip
    if len(nodes) < hosts:
        # Allowed (tests simulate hosts this way), but rarely what a user means: say so.
        shared = (
            f"the trainer's {hosts} hosts (resources.trainer_hosts) run on {len(nodes)} "
            f"node(s): {hosts - len(nodes) + 1} of them share one machine and its devices; on "
            "one machine, one host uses all of its devices (resources.trainer_hosts = 1)"
        )
        logger.warning("%s", shared)
        print(f"warning: {shared}", file=sys.stderr)
    coordinator = coordinator_address(group)
    logger.info("the trainer's %d hosts join at %s", hosts, coordinator)
    leader = (
        ray.remote(TrainerService)
        .options(**options, **on_host(group, 0))
        .remote(wc, storage, hub, (coordinator, hosts))
    )
    followers = [
        ray.remote(TrainerFollower)
        .options(**options, **on_host(group, i))
        .remote(attrs.evolve(wc, index=i), coordinator, hosts)
        for i in range(1, hosts)
    ]
    return leader, followers, group


def wait_until_ready(hosts: list[Any], logs: Any) -> dict[str, Any]:
    """Process 0's ``ready()`` once every host of the trainer has set up (a group's hosts set up
    together: the first one that dies fails the wait at once, named, rather than the others
    waiting out their join).

    Raises:
        WorkerLostError: a host's process died while setting up (its log named).
    """
    import ray

    from marin_rl_core.errors import WorkerLostError
    from marin_rl_core.job.checks import first_line

    refs = [host.ready.remote() for host in hosts]
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        index = refs.index(done[0])
        try:
            ray.get(done[0])
        except ray.exceptions.RayActorError as exc:
            name, log = ("trainer", "trainer.log") if index == 0 else (
                f"trainer host {index}", f"trainer-{index}.log")  # fmt: skip
            raise WorkerLostError(
                f"the {name} process died while setting up ({first_line(exc)}); see {logs / log}"
            ) from exc
    return ray.get(refs[0])
