"""The mock env's synthetic tasks."""

from __future__ import annotations

import pytest
from marin_rl_plugins.mock_env import MockEnv, MockEnvConfig

from marin_rl_core import Env, build_registry
from marin_rl_core.models.tokenizer import ArithmeticTokenizer


def numbers(prompt: str) -> list[int]:
    return [int(x) for x in prompt.split(": ", 1)[1].split()]


@pytest.mark.parametrize(
    "task, solve",
    [
        ("count", lambda p: str(len(p.split(": ", 1)[1].split()))),
        ("sort", lambda p: " ".join(map(str, sorted(numbers(p))))),
        ("reverse", lambda p: " ".join(map(str, numbers(p)[::-1]))),
        ("copy", lambda p: " ".join(map(str, numbers(p)))),
        ("max", lambda p: str(max(numbers(p)))),
    ],
)
def test_each_task_poses_problems_with_the_right_answer(task, solve):
    env = MockEnv(MockEnvConfig(task=task, min_items=2, max_items=5))
    assert isinstance(env, Env)
    problems = env.sample_problems(50, mode="train", seed=0)
    assert len(problems) == 50
    for p in problems:
        assert p.prompt.startswith(f"{task}: ")
        assert 2 <= len(p.prompt.split(": ", 1)[1].split()) <= 5
        assert p.answer == solve(p.prompt)
        assert env.score(p, p.answer) == 1.0
        assert env.score(p, p.answer + " 1") == 0.0


def test_examples_from_the_docs():
    env = MockEnv(MockEnvConfig(task="sort"))
    problem = next(
        p for p in env.sample_problems(500, mode="train", seed=1) if len(p.answer.split()) == 3
    )
    assert problem.answer == " ".join(sorted(problem.answer.split(), key=int))
    count = MockEnv(MockEnvConfig(task="count", min_items=3, max_items=3))
    p = count.sample_problems(1, mode="train", seed=0)[0]
    assert p.answer == "3" and p.prompt.count(" ") == 3


def test_train_and_eval_problems_are_disjoint_and_seeded():
    env = MockEnv(MockEnvConfig(task="sort", min_items=3, max_items=4))
    train = {
        p.prompt for seed in range(5) for p in env.sample_problems(100, mode="train", seed=seed)
    }
    held_out = {
        p.prompt for seed in range(5) for p in env.sample_problems(100, mode="eval", seed=seed)
    }
    assert train and held_out and not train & held_out
    a = [p.prompt for p in env.sample_problems(10, mode="eval", seed=7)]
    assert a == [p.prompt for p in env.sample_problems(10, mode="eval", seed=7)]


def test_problems_use_only_arithmetic_tokenizer_tokens():
    tok = ArithmeticTokenizer()
    for task in ("count", "sort", "reverse", "copy", "max"):
        for p in MockEnv(MockEnvConfig(task=task)).sample_problems(20, mode="train", seed=0):
            for text in (p.prompt, p.answer):
                assert tok.unk_id not in tok.encode(text), text


def test_config_errors_name_the_choices():
    with pytest.raises(ValueError, match="choose one of count, sort, reverse, copy, max"):
        MockEnvConfig(task="add")
    with pytest.raises(ValueError, match="max_items"):
        MockEnvConfig(min_items=3, max_items=2)


def test_registered_as_mock():
    record = build_registry().get("env", "mock")
    env = record.build(record.config_class(task="max"))
    assert env.sample_problems(1, mode="eval", seed=0)[0].prompt.startswith("max: ")
