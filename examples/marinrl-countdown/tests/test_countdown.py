"""The countdown env's own tests: marinrl's contract checks, the game's rules, and the run
settings in ``countdown.toml`` that a plugin cannot make itself.

Run them with the package installed: ``pip install -e . && pytest`` (in this directory).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import marinrl_countdown
from marinrl_countdown import CountdownConfig, CountdownEnv, read_move

from marin_rl_core import Action, Problem, Step
from marin_rl_core.testing import ArithmeticTokenizer, check_plugin

RUN_CONFIG = Path(__file__).resolve().parents[1] / "countdown.toml"


def test_countdown_honours_the_env_contract(plugin_registry):
    registry = plugin_registry(marinrl_countdown)  # only this plugin, no entry points
    assert registry.names("env") == ["countdown"]
    check_plugin(registry.get("env", "countdown"))


def play(
    start: int,
    moves: list[str | Action],
    *,
    mode: str = "train",
    config: CountdownConfig | None = None,
) -> list[Step]:
    """Step one episode with ``moves`` (text, or whole actions) until it is done."""
    env = CountdownEnv(config or CountdownConfig())
    episode = env.reset(Problem(id="p", prompt=str(start), info={"start": start, "mode": mode}))
    steps = []
    for turn, move in enumerate(moves):
        action = move if isinstance(move, Action) else Action(text=move, turn=turn)
        steps.append(episode.step(action))
        if steps[-1].done:
            break
    return steps


def test_best_play_wins_and_each_observation_is_the_number_left():
    steps = play(22, ["9", "9", "4"])
    assert [s.observation for s in steps] == ["13", "4", ""]
    assert [s.reward for s in steps] == [0.0, 0.0, 1.0]
    assert [s.done for s in steps] == [False, False, True]
    assert steps[-1].metrics == {"moves": 3.0, "invalid": 0.0, "truncated": 0.0, "won": 1.0}


def test_a_move_is_the_number_the_actions_text_starts_with():
    texts = ["9", " 9 ", "9\n", "9answer", "12", "take 9 of 13", "x", ""]
    assert [read_move(t) for t in texts] == [9, 9, 9, 9, 12, None, None, None]


def test_invalid_moves_take_nothing_and_overshooting_loses():
    steps = play(5, ["x", "0", "12", "6"])  # no number, 0, more than max_take, then too much
    assert [s.observation for s in steps[:3]] == ["5", "5", "5"]
    assert steps[-1].done and steps[-1].reward == 0.0
    assert steps[-1].metrics == {"moves": 4.0, "invalid": 3.0, "truncated": 0.0, "won": 0.0}


def test_running_out_of_moves_loses():
    steps = play(30, ["1", "1", "1", "1", "1"])
    assert len(steps) == 4 and steps[-1].done and steps[-1].reward == 0.0
    assert steps[-1].metrics["won"] == 0.0


def test_a_truncated_action_earns_partial_credit_in_training_and_is_invalid_in_eval():
    cut = Action(text="9", token_ids=(13, 13), truncated=True)  # "9" "9" at max_tokens=2
    (train,) = play(9, [cut])
    assert train.done and train.reward == 0.5 and train.metrics["won"] == 1.0
    for steps in (
        play(9, [cut], mode="eval"),
        play(9, [cut], config=CountdownConfig(partial_credit=0.0)),
    ):
        assert not steps[0].done and steps[0].observation == "9"
        assert steps[0].metrics["invalid"] == 1.0 and steps[0].metrics["truncated"] == 1.0


def test_the_run_config_fits_the_longest_game_in_the_default_models_sequence():
    """``countdown.toml`` sets what the plugin cannot: ``episodes.max_turns`` covers every move,
    and the longest episode (prompt, ``max_moves`` actions of ``max_tokens`` and the numbers
    left between them) fits ``model.max_seq_len``."""
    run = tomllib.loads(RUN_CONFIG.read_text())
    config = CountdownConfig(**{k: v for k, v in run["env"].items() if k != "name"})
    assert run["episodes"]["max_turns"] >= config.max_moves
    tokenizer = ArithmeticTokenizer()
    prompt = max(
        len(tokenizer.encode(str(s), add_bos=True))
        for s in range(config.min_start, config.max_start + 1)
    )
    observation = max(len(tokenizer.encode(str(n))) for n in range(1, config.max_start))
    max_tokens = max(run["sampling"]["max_tokens"], run["eval"]["sampling"]["max_tokens"])
    longest = prompt + config.max_moves * max_tokens + (config.max_moves - 1) * observation
    assert longest <= run["model"]["max_seq_len"], longest
