"""One trainer over several processes (hosts): joining them with ``jax.distributed``, and the few
collective steps the trainer takes together beside the train step itself.

Every process of a trainer group runs the same JAX program over one mesh of all their devices
(levanter builds it from ``jax.devices()``, which then lists every process's devices). Process 0
leads: it alone writes files (a checkpoint's ``state.json``, metrics) and serves weights; the
others take each collective step with it. With one process every function here is the
single-process behaviour (no barrier, nothing gathered).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 300


def join(coordinator: str, num_processes: int, process_id: int, *, timeout_s: int = JOIN_TIMEOUT_S):
    """Join this process to a trainer group of ``num_processes`` (``jax.distributed``, process
    ``process_id``; ``coordinator`` is ``host:port`` of process 0, which serves it). Must run
    before anything else touches JAX's devices. On CPU the processes reduce with gloo.

    Failure (checked with jax 0.10.2): when the others do not join within ``timeout_s``, JAX's
    coordination client ABORTS the process (SIGABRT, exit 134: "DEADLINE_EXCEEDED ...
    RegisterTask") rather than raising; so does a process of a group whose peer dies later.
    Whoever starts the group must watch its processes and turn that exit into its own message.

    Raises:
        TimeoutError: for a failure JAX does raise, naming the coordinator and the group size.
    """
    import jax

    # Collectives between CPU devices of several processes (only the CPU backend reads it).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=timeout_s,
            # The address the others connect to, not every interface (JAX's default).
            coordinator_bind_address=coordinator if process_id == 0 else None,
        )
    except Exception as exc:  # jax raises a bare XlaRuntimeError (DEADLINE_EXCEEDED, ...)
        raise TimeoutError(
            f"trainer process {process_id} of {num_processes} could not join the group at "
            f"{coordinator} within {timeout_s} s: {str(exc).strip().splitlines()[0][:300]}"
        ) from exc
    logger.info(
        "trainer process %d of %d joined at %s: %d local of %d devices",
        process_id, num_processes, coordinator, jax.local_device_count(), jax.device_count(),
    )  # fmt: skip


def is_leader() -> bool:
    """Whether this process leads its group (process 0; always, alone)."""
    import jax

    return jax.process_index() == 0


BARRIER_TIMEOUT_S = 1800
_barriers = 0


def coordination_client() -> Any:
    """The ``jax.distributed`` coordination service's client of this process (its key-value
    store and barriers; private in jax 0.10.2, where nothing public exposes it)."""
    from jax._src import distributed

    return distributed.global_state.client


def barrier(name: str, timeout_s: int = BARRIER_TIMEOUT_S) -> None:
    """Wait until every process of the group reaches the barrier ``name`` (no-op alone). A
    barrier of the coordination service, not a device collective: one process may be busy (host
    0 writing a checkpoint's files) for longer than a collective would wait. Every process
    passes the same barriers in the same order (each is numbered, so a name may recur).

    Raises:
        RuntimeError: not every process arrived within ``timeout_s`` (jax's error).
    """
    import jax

    global _barriers
    if jax.process_count() > 1:
        _barriers += 1
        coordination_client().wait_at_barrier(f"{name}#{_barriers}", timeout_s * 1000)


def host_copy(tree: Any) -> Any:
    """``tree`` with every ``jax.Array`` as a whole numpy array on this host. An array spread over
    other processes' devices is gathered, which every process of the group must do together."""
    import jax
    import numpy as np

    def one(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        if x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)
