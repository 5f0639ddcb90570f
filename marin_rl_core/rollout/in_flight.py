"""New weights while a batch samples (``episodes.in_flight_weights``): a thread that asks the
trainer for newer weights every ``interval`` seconds while the rollout worker samples a batch and
hands them to the engine, which takes them between decode rounds without draining the rows in
flight (an engine with ``in_flight_weights``: the ``kv`` engine). Each rollout then records the
weight steps it spans (:attr:`~marin_rl_core.types.RolloutMetadata.last_weight_step`); the
replay buffer counts its staleness from the oldest.

Without it a worker takes new weights between batches only, and a long batch (a real model's
answers on an accelerator take tens of seconds) is sampled entirely by the weights it started
with, however many steps the trainer makes meanwhile."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def polling_weights(sync: Callable[[], bool], *, interval: float, name: str) -> Iterator[list[int]]:
    """While the ``with`` body runs, call ``sync()`` (which returns whether it swapped in newer
    weights) every ``interval`` seconds on a thread of its own; the yielded list holds the
    number of swaps so far. The thread stops (and is joined, after at most the ``sync`` in
    progress) when the body ends."""
    stop = threading.Event()
    swaps = [0]

    def poll() -> None:
        while not stop.wait(interval):
            try:
                swaps[0] += int(bool(sync()))
            except Exception:  # noqa: BLE001 - the batch goes on with the weights it has
                logger.exception("%s: taking new weights mid-batch failed", name)
                return

    thread = threading.Thread(target=poll, name=f"{name}-weights", daemon=True)
    thread.start()
    try:
        yield swaps
    finally:
        stop.set()
        thread.join()


__all__ = ["polling_weights"]
