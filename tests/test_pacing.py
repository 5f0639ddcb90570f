"""Pacing (marin_rl_core.pacing): when a rollout worker waits for newer weights and when it goes
on, on a clock the tests control (no test here sleeps)."""

from __future__ import annotations

import threading

import pytest

from marin_rl_core.pacing import NO_ANSWER_S, PACED_LIMIT_S, STARVED_S, Pacer, PacingFeedback

BATCH = 8
DELAY = 1  # replay_buffer.max_rollout_step_delay


class Clock:
    """A clock that moves only when the pacer sleeps."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def pacer(clock: Clock, *, share: float = BATCH) -> Pacer:
    return Pacer(share=share, delay=DELAY, name="w0", clock=clock, sleep=clock.sleep)


def test_a_worker_is_ahead_once_it_made_its_share_for_the_steps_its_weights_may_serve():
    p = pacer(Clock())
    assert not p.ahead(-1), "no weights yet: never ahead"
    assert not p.ahead(0)
    p.count_generated(BATCH, step=0)
    assert not p.ahead(0), "one step's worth; the weights may serve delay + 1 steps"
    p.count_generated(BATCH, step=0)
    assert p.ahead(0)
    assert not p.ahead(1), "newer weights: another step's share"
    p.count_generated(BATCH, step=1)
    assert p.ahead(1)


def test_what_one_weight_version_makes_past_what_the_trainer_can_use_is_surplus():
    p = pacer(Clock())
    p.count_generated(3 * BATCH, step=0)  # the trainer was short: the worker went on
    assert p.usable == (DELAY + 1) * BATCH and p.surplus == BATCH
    p.count_generated(BATCH, step=1)
    assert p.usable == (DELAY + 2) * BATCH and p.surplus == BATCH


def test_pacing_off_never_waits():
    p = pacer(Clock(), share=0)
    p.count_generated(100 * BATCH, step=0)
    assert not p.ahead(0)


def test_weights_arriving_end_the_wait_and_their_interval_bounds_the_next_one():
    clock = Clock()
    p = pacer(clock)
    for _ in range(3):
        p.weights_arrived()
        clock.now += 20.0
    assert p.weight_interval == pytest.approx(20.0)
    p.count_generated(2 * BATCH, step=0)
    step = {"now": 0}

    def sync() -> bool:  # newer weights are published after 0.5 s
        if clock.now >= start + 0.5 and step["now"] == 0:
            step["now"] = 1
            return True
        return False

    start = clock.now
    waited = p.wait(lambda: step["now"], sync, threading.Event())
    assert 0.5 <= waited < 0.52 and not p.ahead(1)
    # No trainer to ask: the plain bound, four typical intervals.
    p.count_generated(BATCH, step=1)
    assert p.wait(lambda: 1, lambda: False, threading.Event()) == pytest.approx(80.0, abs=0.01)


def test_a_stop_ends_the_wait():
    p = pacer(Clock())
    p.count_generated(2 * BATCH, step=0)
    stop = threading.Event()
    stop.set()
    assert p.wait(lambda: 0, lambda: False, stop) == 0.0


@pytest.mark.parametrize(
    "trainer",
    ["busy", "starved", "in transit", "newer weights", "dropped", "surplus dropped", "gone"],
)
def test_a_paced_worker_waits_for_a_busy_trainer_and_feeds_a_starved_one(trainer):
    """A worker that has made its share for its weights waits for newer ones while the trainer
    trains (a first step compiling takes long; what it made meanwhile would be stale), generates
    again at once what the trainer dropped unused (so it stays a step ahead after a checkpoint)
    but not the surplus it made past its share (that is what goes stale), goes on once the
    trainer says it has waited with no rollouts arriving and has read what the worker wrote (it
    lost some it counted on), waits while its last batch is still on the way or while the
    trainer has published weights newer than its own (a starved trainer waits for the batch
    made with them: one made now would arrive stale), and without an answer from the trainer
    goes on after the plain bound."""
    clock = Clock()
    p = pacer(clock)
    p.count_generated((DELAY + 1) * BATCH, step=0)  # all it may make with weights of step 0
    if trainer == "surplus dropped":
        p.count_generated(BATCH // 2, step=0)  # made while the trainer starved
    p.written_through = 3  # it wrote batches 0, 1 and 2
    assert p.ahead(0)
    asked = []

    def ask() -> PacingFeedback:
        asked.append(clock.now)
        if trainer == "gone":
            raise ConnectionError("the trainer's actor died")
        if trainer in ("dropped", "surplus dropped"):
            return PacingFeedback(0.0, BATCH // 2, 3)
        starved = 0.0 if trainer == "busy" else 5.0
        published = 1 if trainer == "newer weights" else 0
        return PacingFeedback(starved, 0, 2 if trainer == "in transit" else 3, published)

    p.ask = ask
    waited = p.wait(lambda: 0, lambda: False, threading.Event())
    if trainer in ("busy", "in transit", "newer weights", "surplus dropped"):
        assert waited == pytest.approx(PACED_LIMIT_S, abs=0.01), "waited for, up to the limit"
        assert len(asked) > 100 and p.ahead(0)
    elif trainer == "starved":
        assert waited == pytest.approx(STARVED_S, abs=0.01) and len(asked) == 2
    elif trainer == "dropped":
        assert waited == 0.0 and len(asked) == 1, "what was dropped is generated again at once"
        assert not p.ahead(0) and p.usable == (DELAY + 1) * BATCH - BATCH // 2
    else:
        assert waited == pytest.approx(NO_ANSWER_S, abs=0.01) and len(asked) == 1
        assert p.ask is None, "a trainer that does not answer is not asked again"


def test_a_worker_waits_for_the_newer_weights_a_starved_trainer_published():
    """The trainer trained on the worker's batch, published newer weights and waits for the
    batch made with them; they take 3 s to reach the worker (a loaded machine): the worker
    waits for them rather than making a batch with its old weights that would arrive stale."""
    clock = Clock()
    p = pacer(clock)
    p.count_generated((DELAY + 1) * BATCH, step=0)
    p.written_through = 1
    step = {"now": 0}
    start = clock.now

    def sync() -> bool:
        if clock.now >= start + 3.0 and step["now"] == 0:
            step["now"] = 1
            return True
        return False

    p.ask = lambda: PacingFeedback(clock.now - start + STARVED_S, 0, 1, 1)
    waited = p.wait(lambda: step["now"], sync, threading.Event())
    assert step["now"] == 1 and 3.0 <= waited < 3.02
