"""The reasoning_gym env: any reasoning-gym dataset by name, graded by its own scorer."""

from __future__ import annotations

import pytest
from marin_rl_plugins.reasoning_gym_env import (
    ReasoningGymEnv,
    ReasoningGymEnvConfig,
    extract_answer,
)

from marin_rl_core import build_registry
from marin_rl_core.config import resolve_config


@pytest.fixture(scope="module", autouse=True)
def _reasoning_gym():
    """Imported by the tests that run (~1 s), not by every pytest worker that collects them."""
    pytest.importorskip("reasoning_gym")


def test_problems_come_from_the_named_dataset_and_are_graded_by_its_scorer():
    env = ReasoningGymEnv(ReasoningGymEnvConfig(dataset="leg_counting", size=50, eval_size=10))
    problems = env.sample_problems(4, mode="train", seed=0)
    assert [p.id for p in problems] == [p.id for p in env.sample_problems(4, mode="train", seed=0)]
    problem = problems[0]
    assert "legs" in problem.prompt and "<answer></answer>" in problem.prompt
    right = env.score(problem, f"Counting them up... <answer>{problem.answer}</answer>")
    assert (right.reward, right.metrics) == (1.0, {"format": 1.0, "correct": 1.0})
    wrong = env.score(problem, "<answer>-1</answer>")
    assert wrong.reward == 0.0 and wrong.metrics["format"] == 1.0
    unformatted = env.score(problem, problem.answer)  # no tags: nothing to grade
    assert unformatted.reward == 0.0 and unformatted.metrics == {"format": 0.0, "correct": 0.0}

    held_out = env.sample_problems(100, mode="eval", seed=0)
    assert len(held_out) == 10  # every held-out problem once
    assert not {p.id for p in held_out} & {p.id for p in problems}


def test_answers_are_extracted_three_ways():
    assert extract_answer("a <answer>1</answer> b <answer> 2 </answer>", "answer_tag") == "2"
    assert extract_answer("so \\boxed{\\frac{1}{2}}", "boxed") == "\\frac{1}{2}"
    assert extract_answer("  42 ", "none") == "42"
    assert extract_answer("no tags", "answer_tag") is None


def test_an_unknown_dataset_name_is_a_config_error_with_suggestions():
    from marin_rl_core.errors import ConfigError

    with pytest.raises(ConfigError, match="no dataset 'leg_countin'; did you mean leg_counting"):
        resolve_config(
            build_registry(),
            selections={"env": "reasoning_gym"},
            overrides=['env.dataset="leg_countin"'],
        )
