"""A reward combined from weighted terms (issue 62): ``[[reward.terms]]`` of reward plugins, each
term logged on its own, the reward their weighted sum on every rollout, and an episode a term
could not grade dropped (counted), never scored 0."""

from __future__ import annotations

import json
import sys
import types

import attrs
import numpy as np
import pytest

from marin_rl_core import RewardPlugin, Rollout, build_registry, hookimpl
from marin_rl_core.config import resolve_config
from marin_rl_core.errors import ConfigError, UnknownPluginError
from marin_rl_core.metrics import read_metrics
from marin_rl_core.models.tokenizer import ArithmeticTokenizer
from marin_rl_core.rollout.episode_state import EpisodeResult
from marin_rl_core.rollout.reward_terms import RewardTerms
from marin_rl_core.types import Problem

TWO_TERMS = (
    'reward.terms=[{name = "correct", fn = "env"}, '
    '{name = "brevity", fn = "length", weight = -0.25, config = {free_tokens = 1}}]'
)


def config_with(*overrides, registry=None):
    registry = registry or build_registry()
    return registry, resolve_config(registry, selections={"env": "math"}, overrides=overrides)


def test_terms_are_checked_before_anything_starts():
    with pytest.raises(UnknownPluginError, match=r"(?s)reward.*nosuch.*\$\.reward\.terms\[0\]"):
        config_with('reward.terms=[{name = "x", fn = "nosuch"}]')
    with pytest.raises(ConfigError, match=r"\$\.reward\.terms\[1\]\.name.*more than once"):
        config_with('reward.terms=[{name = "a", fn = "env"}, {name = "a", fn = "length"}]')
    with pytest.raises(
        ConfigError,
        match=r"(?s)free_token.*did you mean .free_tokens.*\$\.reward\.terms\[0\]\.config",
    ):
        config_with('reward.terms=[{name = "l", fn = "length", config = {free_token = 3}}]')
    with pytest.raises(
        ConfigError, match=r"(?s)not a regular expression.*\$\.reward\.terms\[0\]\.config\.pattern"
    ):
        config_with('reward.terms=[{name = "f", fn = "format", config = {pattern = "(["}}]')
    with pytest.raises(ConfigError, match=r"cannot name a reward term"):
        config_with('reward.terms=[{name = "reward", fn = "env"}]')
    # `fn` defaults to the name
    _, config = config_with('reward.terms=[{name = "length", weight = -1}]')
    assert config.reward.terms[0].plugin == "length"


def _episode(tok, prompt, response, reward, *, turns=None):
    if turns is None:
        rollout = Rollout.single_turn(
            env_name="math", lesson_id="l", problem_id="p", prompt_tokens=prompt,
            response_tokens=response, response_logprobs=np.zeros(len(response)), reward=reward,
        )  # fmt: skip
    else:  # two turns: action, observation, action
        (a, obs, b), (r1, r2) = turns
        tokens = [*prompt, *a, *obs, *b]
        mask = [False] * len(prompt) + [True] * len(a) + [False] * len(obs) + [True] * len(b)
        rollout = Rollout(
            env_name="guess", lesson_id="l", problem_id="p", tokens=tokens, loss_mask=mask,
            logprobs=np.zeros(len(tokens)), reward=r1 + r2,
            turn_starts=[len(prompt), len(prompt) + len(a) + len(obs)], turn_rewards=[r1, r2],
        )  # fmt: skip
    return EpisodeResult(rollouts=[rollout])


def test_the_reward_is_the_weighted_sum_and_lands_where_the_env_put_its_own():
    tok = ArithmeticTokenizer()
    registry, config = config_with(
        'reward.terms=[{name = "correct", fn = "env", weight = 2.0}, '
        '{name = "brevity", fn = "length", weight = -0.5, config = {free_tokens = 1}}, '
        '{name = "digits", fn = "format", weight = 0.25, config = {pattern = "^[0-9]+$"}}]'
    )
    terms = RewardTerms(config, registry, tok)
    prompt = tok.encode("1+2=", add_bos=True)
    three = tok.encode("3")
    results = [
        # "3" and its EOS: the terms read the text without the stop token that ended it.
        [_episode(tok, prompt, [*three, tok.eos_id], 1.0), _episode(tok, prompt, three * 3, 0.0)],
        [_episode(tok, prompt, None, 0.0, turns=((three, three, three + three), (0.5, 0.25)))],
    ]
    problems = [Problem(id="a", prompt="1+2="), Problem(id="b", prompt="1+2=")]
    graded = terms.grade(problems, results, lesson_id="l", mode="train")
    assert graded.failures == 0 and not graded.failed
    short, long = results[0][0].rollouts[0], results[0][1].rollouts[0]
    assert short.reward_terms == {"correct": 1.0, "brevity": 1.0, "digits": 1.0}
    assert short.reward == pytest.approx(2.0 * 1 - 0.5 * 1 + 0.25 * 1)
    assert long.reward_terms == {"correct": 0.0, "brevity": 2.0, "digits": 1.0}
    assert long.reward == pytest.approx(0 - 0.5 * 2 + 0.25)
    assert short.turn_rewards.tolist() == pytest.approx([short.reward])
    assert results[0][1].metrics == {
        "reward/correct": 0.0,
        "reward/brevity": 2.0,
        "reward/digits": 1.0,
    }
    # Two turns: the env's turn rewards stay on their turns (times the env term's weight), the
    # other terms go on the last turn; the response text holds the observation between them.
    two = results[1][0].rollouts[0]
    assert two.reward_terms == {"correct": 0.75, "brevity": 2.0, "digits": 1.0}
    assert two.turn_rewards.tolist() == pytest.approx([2 * 0.5, 2 * 0.25 - 0.5 * 2 + 0.25])
    assert two.reward == pytest.approx(sum(two.turn_rewards.tolist()))


@attrs.frozen
class FlakyConfig:
    pass


class Flaky:
    """A reward function that cannot grade responses holding "9" (``None``), and raises once
    told to."""

    raise_next = False

    def __init__(self, config):
        pass

    def score(self, items):
        if Flaky.raise_next:
            raise TimeoutError("the judge did not answer in 30 s")
        return [None if "9" in item.response else 1.0 for item in items]


@pytest.fixture
def flaky_registry():
    module = types.ModuleType("flaky_reward")

    @hookimpl
    def marinrl_register_rewards():
        yield RewardPlugin(name="flaky", summary="test", config_class=FlakyConfig, build=Flaky)

    module.marinrl_register_rewards = marinrl_register_rewards
    sys.modules["flaky_reward"] = module
    yield build_registry(modules=[module])
    del sys.modules["flaky_reward"]


def test_an_episode_a_term_cannot_grade_drops_its_problem_and_is_counted(flaky_registry):
    tok = ArithmeticTokenizer()
    registry, config = config_with(
        'reward.terms=[{name = "correct", fn = "env"}, {name = "judge", fn = "flaky"}]',
        registry=flaky_registry,
    )
    terms = RewardTerms(config, registry, tok)
    prompt = tok.encode("1+2=", add_bos=True)
    results = [
        [_episode(tok, prompt, tok.encode("3"), 1.0), _episode(tok, prompt, tok.encode("9"), 0.0)],
        [_episode(tok, prompt, tok.encode("3"), 1.0)],
    ]
    problems = [Problem(id="a", prompt="x"), Problem(id="b", prompt="y")]
    graded = terms.grade(problems, results, lesson_id="l", mode="train")
    assert graded.failed == {0} and graded.failures == 1
    assert results[1][0].rollouts[0].reward == 2.0  # graded: 1 + 1
    Flaky.raise_next = True
    try:
        again = [[attrs.evolve(r) for r in p] for p in results]
        graded = terms.grade(problems, again, lesson_id="l", mode="train")
    finally:
        Flaky.raise_next = False
    assert graded.failed == {0, 1} and graded.failures == 3


def test_a_math_job_logs_each_term_and_trains_on_their_weighted_sum(cli, tmp_path):
    """The bar: a job on the math task with two weighted terms (correctness and a length
    penalty) logs both and their weighted total, and every saved rollout's reward is the sum
    computed by hand from its terms."""
    run_dir = tmp_path / "runs"
    result = cli(
        "run", "--env", "math",
        "--set", 'curriculum.lessons=[{id = "add", env_config = {task = "add_1digit"}}]',
        "--set", "trainer.batch_size=32", "--set", "sampling.n_prompts=4",
        "--set", "sampling.max_tokens=3", "--set", "eval.sampling.max_tokens=3",
        "--set", "eval.n_examples=8", "--set", "eval.frequency=100",
        "--set", "trainer.num_train_steps=3", "--set", "logging.samples_per_step=32",
        "--set", TWO_TERMS, "--set", f'run_dir="{run_dir}"', "--run-id", "terms",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    run = run_dir / "terms"
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 32
    for row in samples:
        terms = row["reward_terms"]
        assert set(terms) == {"correct", "brevity"} and 0.0 <= terms["correct"] <= 1.0
        assert row["reward"] == pytest.approx(1.0 * terms["correct"] - 0.25 * terms["brevity"])
    assert any(row["reward_terms"]["brevity"] > 0 for row in samples), "no response ran long"
    rows = read_metrics(run)
    batches = [r for r in rows if r["source"] == "rollout" and "rollout/reward/brevity" in r]
    assert batches and all(r["rollout/reward_failures"] == 0 for r in batches)
    for r in batches:
        total = r["rollout/reward/correct"] - 0.25 * r["rollout/reward/brevity"]
        assert r["rollout/reward"] == pytest.approx(total)
    evals = [r for r in rows if r["source"] == "eval"]
    assert evals and all("eval/add/reward/brevity" in r for r in evals)
    last = evals[-1]
    assert last["eval/add/reward"] == pytest.approx(
        last["eval/add/reward/correct"] - 0.25 * last["eval/add/reward/brevity"]
    )
