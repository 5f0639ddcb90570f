"""A colocated job (``resources.colocate``): the trainer and rollout worker 0 in one process, on
the same devices.

:class:`ColocatedService` is one Ray actor that holds a
:class:`~marin_rl_core.job.actors.TrainerService` and a
:class:`~marin_rl_core.job.actors.RolloutService` built in its process, joined by an in-process
weight transfer (:class:`LocalTransfer`): the trainer's published weights (its own copy in the
inference dtype, which no train step donates) are handed to the sampler as they are, placed in
the sampler's shardings where those differ; nothing is serialized or sent. The two run in two
threads of the actor; with ``replay_buffer.max_rollout_step_delay = 0`` (a colocated job's
default, :mod:`marin_rl_core.config.colocation`) the worker's pacing makes them take turns: the
sampler generates a step's batch with the newest weights, then waits while the trainer trains
on it and publishes the next weights.

The driver's :class:`~marin_rl_core.job.watch.Watch` sees the actor twice: as the trainer, and
through :class:`RolloutView` as rollout worker 0. The process logs to both ``logs/trainer.log``
and ``logs/rollout-0.log``. Its death is the trainer's: the job stops and resumes from the last
checkpoint (``marinrl run --resume``), as a lost trainer's does.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from marin_rl_core.job.actors import RolloutService, TrainerService, WorkerConfig
from marin_rl_core.types import ReceivedWeights
from marin_rl_core.weight_leaves import array_leaves, check_fits, describe

ADDRESS = "in-process"
"""The weight server's address in a colocated process (there is nothing to connect to)."""


class LocalWeightServer:
    """Keeps the newest published weights for the process's :class:`LocalWeightClient`."""

    address = ADDRESS

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._model: Any = None
        self._step = -1

    def publish(self, model: Any, *, weight_step: int) -> None:
        with self._lock:
            self._model, self._step = model, int(weight_step)

    def latest(self) -> tuple[Any, int]:
        with self._lock:
            return self._model, self._step

    def close(self) -> None:
        with self._lock:
            self._model = None


class LocalWeightClient:
    """Receives the server's newest weights without copying them (see the module docstring)."""

    def __init__(self, server: LocalWeightServer):
        self._server = server
        self._step = -1

    def receive(self, like_model: Any) -> ReceivedWeights | None:
        import jax

        start = time.monotonic()
        model, step = self._server.latest()
        if model is None or step <= self._step:
            return None
        leaves, treedef, index, paths = array_leaves(like_model)
        served, _, served_index, served_paths = array_leaves(model)
        like = [leaves[i] for i in index]
        arrays = [served[i] for i in served_index]
        check_fits(describe(arrays, served_paths), like, paths, source="the trainer", step=step)
        for k, i in enumerate(index):
            old, new = leaves[i], arrays[k]
            # The trainer's mesh may not be the sampler's (several devices): place it there.
            where = getattr(old, "sharding", None)
            leaves[i] = (
                new if where is None or new.sharding == where else jax.device_put(new, where)
            )
        self._step = step
        return ReceivedWeights(
            model=jax.tree_util.tree_unflatten(treedef, leaves),
            weight_step=step,
            nbytes=0,  # nothing moved
            seconds=time.monotonic() - start,
            latest_step=self._server.latest()[1],
        )

    def close(self) -> None:
        pass


class LocalTransfer:
    """The weight transfer of a colocated process: one server, clients of it by its address."""

    def __init__(self) -> None:
        self._server = LocalWeightServer()

    def server(self) -> LocalWeightServer:
        return self._server

    def client(self, address: str) -> LocalWeightClient:
        return LocalWeightClient(self._server)


class ColocatedService(TrainerService):
    """The trainer (this class's :class:`TrainerService` methods) and rollout worker 0
    (``rollout_*`` methods, seen through :class:`RolloutView`) in one process: see the module
    docstring. Built in that order, so that the sampler's memory budget is a share of what the
    trainer leaves free."""

    def __init__(self, wc: WorkerConfig, rollout_wc: WorkerConfig, storage: Any, hub: str):
        transfer = LocalTransfer()
        super().__init__(wc, storage, hub, transfer=transfer)
        # The sampler starts from the trainer's first published weights (handed over, as every
        # later publish is): reading the checkpoint a second time would hold a second copy of
        # the model, and levanter's load peaks at several times the model's bytes.
        initial = None
        if self._setup_error is None:
            self.trainer.publish()
            initial = transfer.server().latest()[0]
        self.rollout = RolloutService(
            rollout_wc, storage, hub, transfer=transfer, initial_model=initial
        )
        if self._setup_error is None:
            self._setup_error = self.rollout._setup_error

    def rollout_run(self, address: str, start_batch: int = 0, trainer: Any = None) -> Any:
        """Rollout worker 0's run (see :meth:`RolloutService.run`); it asks the trainer beside it
        about pacing directly."""
        self._check()
        self.rollout._connect(address, start_batch)
        worker = self.rollout.worker
        if worker.pacer.ask is None:
            worker_id, worker_index = worker.worker_id, worker.worker_index
            worker.pacer.ask = lambda: self.trainer.pacing_feedback(worker_id, worker_index)
        return self.rollout.run(address, start_batch)

    def rollout_stop(self) -> None:
        self.rollout.stop()

    def rollout_final_eval(self, step: int, address: str, timeout: float) -> dict[str, float]:
        self._check()
        return self.rollout.final_eval(step, address, timeout)

    def rollout_counters(self) -> dict[str, int]:
        self._check()
        return self.rollout.counters()

    def process(self) -> int:
        return os.getpid()


class RolloutView:
    """Rollout worker 0 of a :class:`ColocatedService` actor, with the methods the driver's
    watch calls on a rollout worker's actor (``run``, ``stop``, ``final_eval``, ``counters``,
    ``process``: each ``.remote(...)``)."""

    def __init__(self, actor: Any):
        self.actor = actor
        self.run = actor.rollout_run
        self.stop = actor.rollout_stop
        self.final_eval = actor.rollout_final_eval
        self.counters = actor.rollout_counters
        self.process = actor.process
