"""The package's own tests: the env keeps marinrl's contract, and its run config takes its reward
from a judge and a length penalty whose settings the installed plugins accept."""

import tomllib
from pathlib import Path

from marin_rl_core import build_registry
from marin_rl_core.testing import check_plugin

RUN_CONFIG = Path(__file__).resolve().parents[1] / "describe.toml"


def test_the_env_honours_the_contract():
    record = build_registry().get("env", "describe")
    check_plugin(record)
    env = record.build(record.config_class())
    (problem,) = env.sample_problems(1, mode="train", seed=0)
    score = env.score(problem, "a cat purrs")
    assert score.reward == 0.0 and score.metrics == {"words": 3, "letters": 9, "characters": 11}


def test_the_run_config_takes_its_reward_from_a_judge_and_a_length_penalty():
    registry = build_registry()
    judge, length = tomllib.loads(RUN_CONFIG.read_text())["reward"]["terms"]
    assert (judge["fn"], length["fn"], length["weight"]) == ("judge", "length", -0.05)
    settings = registry.get("reward", "judge").config_class(**judge["config"])  # validated
    assert "{response}" in settings.prompt and "Score: N" in settings.prompt
    registry.get("reward", "length").config_class(**length["config"])
