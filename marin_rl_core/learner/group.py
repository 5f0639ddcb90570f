"""How the processes of a trainer group stay in step: process 0 (the leader) runs the trainer's
loop, reading rollouts, sampling batches and deciding when to publish and checkpoint; before
each collective operation it tells the others (the followers) which one, and for a train step
the rollouts and advantages it sampled, so that every process runs the same JAX program on the
same data. The commands travel over JAX's own collectives (a broadcast from process 0), so a
group needs nothing beside ``jax.distributed``.

A command is a JSON header (``op``, the step, the advantages) and, for a step, the rollouts in
marinrl's Arrow wire format (:mod:`~marin_rl_core.rollout_serialization`): nothing is unpickled.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from marin_rl_core.learner.multihost import is_leader
from marin_rl_core.types import Rollout

STEP, PUBLISH, CHECKPOINT, STOP = "step", "publish", "checkpoint", "stop"


def _broadcast(data: bytes | None) -> bytes:
    """``data`` of process 0, on every process (its length first, then its bytes)."""
    from jax.experimental import multihost_utils

    length = np.asarray([0 if data is None else len(data)], np.int64)
    length = int(multihost_utils.broadcast_one_to_all(length)[0])
    buffer = np.zeros(max(length, 1), np.uint8)
    if data is not None:
        buffer[:length] = np.frombuffer(data, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buffer))[:length].tobytes()


class GroupChannel:
    """The leader's commands to its followers; with one process, nothing is sent."""

    def __init__(self) -> None:
        import jax

        self.size = jax.process_count()
        self.leads = is_leader()
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

        header = {"op": op, "step": step}
        body = b""
        if rollouts is not None:
            header["advantages"] = [float(a) for a in np.asarray(advantages, np.float32)]
            body = serialize_rollout_batch(RolloutBatch(groups=[RolloutGroup(rollouts=rollouts)]))
        head = json.dumps(header).encode()
        _broadcast(len(head).to_bytes(8, "little") + head + body)
        self.pending = op

    def done(self) -> None:
        self.pending = None

    def receive(self, step: int) -> tuple[str, list[Rollout] | None, np.ndarray | None]:
        """A follower's next command: ``(op, rollouts, advantages)``.

        Raises:
            RuntimeError: the leader is at another step than this follower's ``step``.
        """
        from marin_rl_core.rollout_serialization import deserialize_rollout_batch

        data = _broadcast(None)
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + size])
        rollouts = advantages = None
        if "advantages" in header:
            rollouts = deserialize_rollout_batch(data[8 + size :]).rollouts
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
