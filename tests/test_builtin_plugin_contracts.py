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
