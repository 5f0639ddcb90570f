"""The ``reward_model`` reward term (issue 62): a learned reward model, a Hugging Face
sequence-classification checkpoint (a Llama/Qwen body with a scalar head), run on levanter in
the rollout worker; its scores are ``transformers``' own for the same conversation."""

from __future__ import annotations

import math

import pytest
from marin_rl_plugins.reward_model import RewardModelConfig, RewardModelTerm, preflight

from marin_rl_core import ExitCode, Problem, RewardInput
from marin_rl_core.testing import write_tiny_hf_checkpoint

RESPONSES = ["3", "33", "1+2=3", "12*3=36", "7", "9-4=5"]


def items(responses, prompt="1+2="):
    problem = Problem(id="p", prompt=prompt, answer="3")
    return [
        RewardInput(problem=problem, response=r, response_tokens=len(r), env_reward=0.0)
        for r in responses
    ]


def transformers_scores(path, responses, prompt="1+2="):
    """What ``transformers`` scores each response with: its sequence classifier on the chat
    template's rendering of the user's prompt and the assistant's response."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    scores = []
    for response in responses:
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        with torch.no_grad():
            scores.append(float(model(torch.tensor([ids])).logits[0, 0]))
    return scores


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_reward_model_scores_as_transformers_does(tmp_path, model_type):
    path = write_tiny_hf_checkpoint(tmp_path / "rm", model_type, head="score", seed=5)
    term = RewardModelTerm(RewardModelConfig(checkpoint=str(path), batch_size=4))
    got = term.score(items(RESPONSES))
    expected = transformers_scores(path, RESPONSES)
    assert got == pytest.approx(expected, abs=1e-4)
    assert max(expected) - min(expected) > 0.1, "the scores do not tell responses apart"
    # The same model as transformers 5 writes it (levanter pins transformers 4: compared to it).
    five = write_tiny_hf_checkpoint(
        tmp_path / "rm5", model_type, head="score", seed=5, layout="transformers5"
    )
    assert RewardModelTerm(RewardModelConfig(checkpoint=str(five))).score(
        items(RESPONSES)
    ) == pytest.approx(expected, abs=1e-4)
    # As a probability: the sigmoid of the same scores.
    sig = RewardModelTerm(RewardModelConfig(checkpoint=str(path), sigmoid=True))
    assert sig.score(items(RESPONSES[:2])) == pytest.approx(
        [1 / (1 + math.exp(-s)) for s in expected[:2]], abs=1e-5
    )


def test_an_episode_too_long_for_the_reward_model_is_no_grade_and_it_says_why(tmp_path):
    path = write_tiny_hf_checkpoint(tmp_path / "rm", "qwen3", head="score")
    term = RewardModelTerm(RewardModelConfig(checkpoint=str(path), max_seq_len=24))
    got = term.score(items(["3", "1234567890" * 3]))
    assert got[0] is not None and got[1] is None
    assert "raise the reward model's max_seq_len" in term.last_error


def test_what_is_not_a_reward_model_is_refused_before_the_job_starts(tmp_path, cli):
    causal = write_tiny_hf_checkpoint(tmp_path / "lm", "qwen3")
    (problem,) = preflight(RewardModelConfig(checkpoint=str(causal)))
    assert "Qwen3ForCausalLM checkpoint, not a sequence classifier" in problem
    two = write_tiny_hf_checkpoint(tmp_path / "two", "llama", head="score", num_labels=2)
    (problem,) = preflight(RewardModelConfig(checkpoint=str(two)))
    assert "has 2 outputs (num_labels)" in problem
    run_dir = tmp_path / "runs"
    result = cli(
        "run", "--env", "math", "--set", f'run_dir="{run_dir}"', "--set",
        f'reward.terms=[{{name = "rm", fn = "reward_model", config = {{checkpoint = "{causal}"}}}}]',
    )  # fmt: skip
    assert result.exit_code == ExitCode.CONFIG, result.output
    assert "$.reward.terms[0] ('rm', fn reward_model)" in " ".join(result.output.split())
    assert not run_dir.exists()


def test_model_terms_score_a_job_from_its_rollout_worker(cli, tmp_path):
    """A math job rewarded by its env, a reward model and a judge run from a local checkpoint,
    both loaded by the rollout worker: every saved rollout's reward is the weighted sum of the
    three, each logged on its own."""
    import json

    from marin_rl_core.metrics import read_metrics

    rm = write_tiny_hf_checkpoint(tmp_path / "rm", "qwen3", head="score", seed=5)
    judge = write_tiny_hf_checkpoint(tmp_path / "judge", "qwen3", seed=3)
    terms = (
        'reward.terms=[{name = "correct", fn = "env"}, '
        f'{{name = "rm", fn = "reward_model", weight = 0.5, config = {{checkpoint = "{rm}"}}}}, '
        f'{{name = "judged", fn = "judge", weight = 0.1, config = {{checkpoint = "{judge}", '
        'prompt = "{prompt}{response}=", score_pattern = "(\\\\d)", max_score = 9, max_tokens = 8, '
        'max_seq_len = 64, cache = ""}}]'
    )
    run_dir = tmp_path / "runs"
    result = cli(
        "run", "--env", "math",
        "--set", 'curriculum.lessons=[{id = "add", env_config = {task = "add_1digit"}}]',
        "--set", "trainer.batch_size=16", "--set", "sampling.n_prompts=2",
        "--set", "sampling.max_tokens=3", "--set", "eval.sampling.max_tokens=3",
        "--set", "eval.n_examples=4", "--set", "eval.frequency=100",
        "--set", "trainer.num_train_steps=2", "--set", "logging.samples_per_step=16",
        "--set", "resources.colocate=true",
        "--set", terms, "--set", f'run_dir="{run_dir}"', "--run-id", "models",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    run = run_dir / "models"
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples
    for row in samples:
        t = row["reward_terms"]
        assert 0.0 <= t["judged"] <= 1.0
        assert row["reward"] == pytest.approx(t["correct"] + 0.5 * t["rm"] + 0.1 * t["judged"])
    assert len({row["reward_terms"]["rm"] for row in samples}) > 1
    rows = read_metrics(run)
    batches = [r for r in rows if r["source"] == "rollout" and "rollout/reward/rm" in r]
    assert batches and all("rollout/reward/judged" in r for r in batches)
