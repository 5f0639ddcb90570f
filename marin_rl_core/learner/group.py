"""How the processes of a trainer group stay in step: process 0 (the leader) runs the trainer's
loop, reading rollouts, sampling batches and deciding when to publish and checkpoint; before
each collective operation it tells the others (the followers) which one, and for a train step
the rollouts and advantages it sampled, so that every process runs the same JAX program on the
same data. A group needs nothing beside ``jax.distributed``:

- each command's JSON header (``op``, the step, the advantages, the size of its payload) goes
  through the coordination service's key-value store, where a follower waits for it as long as
  the leader waits for rollouts (in bounded gets, while the leader lives): a collective would
  wait for the leader inside the device program, and on CPU gloo gives up a first collective
  after 30 s;
- a step's rollouts, in marinrl's Arrow wire format (:mod:`~marin_rl_core.rollout_serialization`:
  nothing is unpickled), follow as a broadcast from process 0 that every process enters at once,
  having read the header.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from typing import Any

import numpy as np

from marin_rl_core.learner.multihost import coordination_client, is_leader
from marin_rl_core.types import Rollout

logger = logging.getLogger(__name__)

STEP, PUBLISH, CHECKPOINT, STOP = "step", "publish", "checkpoint", "stop"
POLL_MS = 60_000
"""A follower's wait for the next command, in bounded gets of this long."""


def _broadcast(data: bytes | None, length: int) -> bytes:
    """``data`` (``length`` bytes) of process 0, on every process."""
    from jax.experimental import multihost_utils

    buffer = np.zeros(max(length, 1), np.uint8)
    if data is not None:
        buffer[:length] = np.frombuffer(data, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buffer))[:length].tobytes()


_CHANNELS = itertools.count()
"""The channels this process made: the index in each key's name."""


class GroupChannel:
    """The leader's commands to its followers; with one process, nothing is sent."""

    def __init__(self) -> None:
        import jax

        self.size = jax.process_count()
        self.leads = is_leader()
        # Every process of the group makes its channels in the same order (one per trainer),
        # so the n-th channel's keys are the same on each, and a second trainer in the same
        # processes (a run after a run) does not read the first one's commands.
        self.prefix = f"marinrl/group/{next(_CHANNELS)}"
        self.sent = 0
        """Commands sent (the leader) or received (a follower): the next one's key."""
        self.pending: str | None = None
        """The command sent whose operation the leader has not finished (:meth:`done`)."""

    @property
    def grouped(self) -> bool:
        return self.size > 1

    def send(
        self,
        op: str,
        step: int,
        rollouts: list[Rollout] | None = None,
        advantages: np.ndarray | None = None,
    ) -> None:
        """Tell the followers the leader's next collective operation (a no-op alone or on a
        follower, which received it already)."""
        if not (self.grouped and self.leads):
            return
        from marin_rl_core.rollout_serialization import serialize_rollout_batch
        from marin_rl_core.types import RolloutBatch, RolloutGroup

        header: dict[str, Any] = {"op": op, "step": step, "bytes": 0}
        body = None
        if rollouts is not None:
            header["advantages"] = [float(a) for a in np.asarray(advantages, np.float32)]
            body = serialize_rollout_batch(RolloutBatch(groups=[RolloutGroup(rollouts=rollouts)]))
            header["bytes"] = len(body)
        client = coordination_client()
        if self.sent:  # every follower read the one before: it took part in its operation
            client.key_value_delete(f"{self.prefix}/{self.sent - 1}")
        client.key_value_set(f"{self.prefix}/{self.sent}", json.dumps(header))
        self.sent += 1
        if body is not None:
            _broadcast(body, len(body))
        self.pending = op

    def done(self) -> None:
        self.pending = None

    def receive(self, step: int) -> tuple[str, list[Rollout] | None, np.ndarray | None]:
        """A follower's next command: ``(op, rollouts, advantages)``. It waits as long as the
        leader takes (its death ends the wait: the coordination service is the leader's).

        Raises:
            RuntimeError: the leader is at another step than this follower's ``step``.
        """
        from marin_rl_core.rollout_serialization import deserialize_rollout_batch

        key, waited = f"{self.prefix}/{self.sent}", time.monotonic()
        while True:
            try:
                header = json.loads(coordination_client().blocking_key_value_get(key, POLL_MS))
                break
            except Exception as exc:  # noqa: BLE001 - jax raises a bare runtime error
                if "DEADLINE_EXCEEDED" not in str(exc):
                    raise
                logger.info("waiting for the leader's next command for %.0f s",
                            time.monotonic() - waited)  # fmt: skip
        self.sent += 1
        rollouts = advantages = None
        if header["bytes"]:
            body = _broadcast(None, header["bytes"])
            rollouts = deserialize_rollout_batch(body).rollouts
            advantages = np.asarray(header["advantages"], np.float32)
        if header["op"] != STOP and header["step"] != step:
            raise RuntimeError(
                f"the trainer group's leader is at step {header['step']}, this process at {step}"
            )
        return header["op"], rollouts, advantages


def gathered_for_serving(model: Any) -> Any:
    """``model`` (spread over a group's devices) gathered whole into this host's memory (numpy
    leaves), for the leader's weight server: no device of the leader need hold the whole model
    beside its shards of the training state. Every process of the group takes part (each gets
    the whole model; only the leader serves it). Alone: ``model`` itself."""
    import jax

    if jax.process_count() == 1:
        return model
    from marin_rl_core.learner.multihost import host_copy

    return host_copy(model)
