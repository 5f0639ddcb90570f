"""Every built-in plugin passes the same contract checks a third-party author runs."""

from __future__ import annotations

import pytest

from marin_rl_core import build_registry
from marin_rl_core.testing import check_plugin

REGISTRY = build_registry()
ENTRIES = REGISTRY.entries()


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: f"{e.kind}:{e.name}")
def test_builtin_plugin_honours_its_contract(entry):
    assert entry.distribution == "marin-rl"
    check_plugin(entry.record)


def test_the_kinds_the_product_promises_are_built_in():
    for kind, name in [
        ("env", "math"),
        ("env", "mock"),
        ("loss", "rloo"),
        ("storage", "memory"),
        ("weight_transfer", "arrow_flight"),
        ("weight_transfer", "jax"),
        ("storage", "gcs"),
        ("curriculum", "default"),
    ]:
        assert name in REGISTRY.names(kind), f"{kind} {name!r} is missing"


def test_the_contract_check_catches_default_lessons_a_run_would_refuse():
    import attrs

    from marin_rl_core import EnvPlugin, LessonConfig, LessonDependency
    from marin_rl_core.testing import check_default_lessons

    math = REGISTRY.get("env", "math")

    def record(*lessons):
        return attrs.evolve(math, default_lessons=lambda config: list(lessons))

    with pytest.raises(AssertionError, match="depends on unknown lessons"):
        check_default_lessons(
            record(LessonConfig(id="a", dependencies=(LessonDependency(lesson="b"),)))
        )
    with pytest.raises(AssertionError, match="not a valid MathEnvConfig"):
        check_default_lessons(record(LessonConfig(id="a", env_config={"taks": "add_1digit"})))
    with pytest.raises(AssertionError, match="ids repeat"):
        check_default_lessons(record(LessonConfig(id="a"), LessonConfig(id="a")))
    assert isinstance(math, EnvPlugin)
    check_default_lessons(math)  # the shipped lessons pass


def test_the_contract_check_fails_an_env_call_that_hangs_instead_of_hanging():
    """A multi-turn env whose step never returns: the check names the call and gives up after
    its timeout (an unbounded check hung a plugin author's test run for good)."""
    import threading

    import attrs

    from marin_rl_core.testing import check_plugin

    release = threading.Event()

    class HangingEpisode:
        def step(self, action):
            release.wait()  # hangs until the test ends

    guess = REGISTRY.get("env", "guess")
    inner_build = guess.build

    class HangingEnv:
        def __init__(self, env):
            self.env = env

        def sample_problems(self, n, *, mode, seed):
            return self.env.sample_problems(n, mode=mode, seed=seed)

        def reset(self, problem):
            return HangingEpisode()

    record = attrs.evolve(guess, build=lambda config: HangingEnv(inner_build(config)))
    try:
        with pytest.raises(AssertionError, match=r"env 'guess': step\(\) of problem .* did not "
                           r"return within 0.5 s"):  # fmt: skip
            check_plugin(record, timeout_s=0.5)
    finally:
        release.set()
    check_plugin(guess, timeout_s=30)  # the real one passes
