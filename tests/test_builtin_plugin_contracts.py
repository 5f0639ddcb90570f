"""Every built-in plugin passes the same contract checks a third-party author runs."""

from __future__ import annotations

import pytest

from marin_rl_core import build_registry
from marin_rl_core.testing import check_plugin

REGISTRY = build_registry()
ENTRIES = REGISTRY.entries()


@pytest.fixture
def local_ray(start_local_ray):
    """A local Ray for the ``memory`` storage's queue actor, stopped after (``RAY_AUTH_MODE``,
    which ``ray.init`` sets in this process, given back)."""
    pytest.importorskip("ray")
    local = start_local_ray(1)
    yield
    local.stop()


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: f"{e.kind}:{e.name}")
def test_builtin_plugin_honours_its_contract(entry, request, tmp_path):
    assert entry.distribution == "marin-rl"
    if (entry.kind, entry.name) == ("storage", "memory"):
        request.getfixturevalue("local_ray")  # its queue is a Ray actor
    if (entry.kind, entry.name) == ("reward", "judge"):  # it needs an endpoint to ask
        from judge_server import JudgeServer
        from marin_rl_plugins.judge import JudgeConfig

        with JudgeServer() as server:
            check_plugin(entry.record, JudgeConfig(url=server.url, cache=""))
        return
    if (entry.kind, entry.name) == ("reward", "reward_model"):  # it needs a checkpoint
        from marin_rl_plugins.reward_model import RewardModelConfig

        from marin_rl_core.testing import write_tiny_hf_checkpoint

        path = write_tiny_hf_checkpoint(tmp_path / "rm", "qwen3", head="score")
        check_plugin(entry.record, RewardModelConfig(checkpoint=str(path)))
        return
    check_plugin(entry.record)


class ForgetfulStorage:
    """The ``gcs`` storage with a reader that forgets where it was."""

    def __init__(self, storage):
        self.storage = storage

    def writer(self, *, name=""):
        return self.storage.writer(name=name)

    def reader(self, position=None):
        return self.storage.reader(None)  # ignores the position: a resume reads it all again

    def close(self):
        self.storage.close()


def test_the_storage_check_is_a_real_round_trip():
    """A storage whose resumed reader returns batches again, or that does not pickle, fails the
    check with what is wrong."""
    import threading

    import attrs

    gcs = REGISTRY.get("storage", "gcs")
    record = attrs.evolve(gcs, build=lambda c, run: ForgetfulStorage(gcs.build(c, run)))
    keep = gcs.config_class(retention="keep")  # the batches read stay, to be read again
    with pytest.raises(AssertionError, match=r"a reader resumed at .* returned \['check-\d/0'\]"):
        check_plugin(record, keep)

    def unpicklable(config, run):
        storage = ForgetfulStorage(gcs.build(config, run))
        storage.lock = threading.Lock()
        return storage

    with pytest.raises(AssertionError, match="must pickle"):
        check_plugin(attrs.evolve(gcs, build=unpicklable))


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
