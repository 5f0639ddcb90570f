"""The ``judge`` reward term (issue 62): a model behind an OpenAI-compatible endpoint, or a local
checkpoint on marinrl's own engine, grades each response against a rubric; requests go out a few
at a time, retried, cached by request; a judge that cannot answer never becomes a 0, and one
that stays down stops the job, naming it; a resumed job does not ask again what it was told."""

from __future__ import annotations

import json
import threading
from collections import Counter

import pytest
from judge_server import JudgeServer, grade_of
from marin_rl_plugins.judge import Judge, JudgeConfig

from marin_rl_core import Problem, RewardInput, build_registry
from marin_rl_core.config import resolve_config
from marin_rl_core.errors import ExitCode, StalledError
from marin_rl_core.metrics import read_metrics
from marin_rl_core.models.tokenizer import ArithmeticTokenizer
from marin_rl_core.rollout.reward_terms import RewardTerms
from marin_rl_core.testing import check_plugin, write_tiny_hf_checkpoint

RESPONSES = ["3", "33", "it is 3", "", "three", "3 3 3 3 3 3 3 3", "4", "12345678901"]


def items(responses):
    problem = Problem(id="p", prompt="1+2=", answer="3")
    return [
        RewardInput(problem=problem, response=r, response_tokens=len(r), env_reward=0.0)
        for r in responses
    ]


@pytest.fixture
def server():
    with JudgeServer() as s:
        yield s


def test_the_judge_grades_a_batch_a_few_requests_at_a_time_and_caches_them(server, tmp_path):
    config = JudgeConfig(url=server.url, concurrency=3, cache=str(tmp_path / "judge.sqlite"))
    judge = Judge(config)
    got = judge.score(items(RESPONSES))
    assert got == [grade_of(r) / 10 for r in RESPONSES]
    assert server.requests == len(RESPONSES) and 1 < server.max_in_flight <= 3
    # Asked again, by this judge or a new one on the same cache (a resumed job): no request.
    assert judge.score(items(RESPONSES)) == got
    assert Judge(config).score(items(RESPONSES[::-1])) == got[::-1]
    assert server.requests == len(RESPONSES)
    # The rubric and the scale are the user's: a 0..20 scale maps to [0, 1] too.
    twenty = JudgeConfig(
        url=server.url, cache="", prompt="Rate 0-20.\nResponse:\n{response}", max_score=20,
        score_pattern=r"Score: (\d+)",
    )  # fmt: skip
    assert Judge(twenty).score(items(["3", "3"])) == [0.5, 0.5]
    assert server.requests == len(RESPONSES) + 1  # the same request in a batch: asked once
    check_plugin(build_registry().get("reward", "judge"), JudgeConfig(url=server.url, cache=""))


def test_a_failing_request_is_retried_and_one_without_a_score_is_no_grade(server, tmp_path):
    cache = str(tmp_path / "judge.sqlite")
    server.fail_next = 2  # two 500s: the client's backoff tries again
    judge = Judge(JudgeConfig(url=server.url, concurrency=1, cache=cache, retries=3))
    assert judge.score(items(["3", "33"])) == [1.0, 0.9]
    assert server.requests == 4
    server.garble = True  # "I like it.": no score, so no grade (and nothing cached)
    assert judge.score(items(["4"])) == [None]
    assert "without a score" in judge.last_error
    server.garble = False
    assert judge.score(items(["4"])) == [1.0]


def transformers_reply(path):
    """What a server running the checkpoint at ``path`` with ``transformers`` answers: greedy
    decoding of the chat-templated messages, up to the checkpoint's stop ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marin_rl_core import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    hf = AutoTokenizer.from_pretrained(path)
    stops = list(load_tokenizer(str(path)).stop_ids)
    lock = threading.Lock()

    def reply(messages, max_tokens):
        text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = hf.encode(text, add_special_tokens=False)
        with lock, torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                eos_token_id=stops, pad_token_id=stops[0],
            )  # fmt: skip
        return hf.decode(
            [t for t in out[0, len(ids) :].tolist() if t not in stops], skip_special_tokens=True
        )

    return reply


def test_a_local_checkpoint_judge_grades_a_batch_as_an_endpoint_serving_it_does(tmp_path):
    """The same checkpoint as the judge two ways: loaded by the judge into marinrl's kv engine
    (one batched call), and behind a loopback OpenAI-compatible server running it with
    ``transformers``: the same replies, so the same grades, for the same batch."""
    path = write_tiny_hf_checkpoint(tmp_path / "judge", "qwen3", seed=3)
    rubric = dict(prompt="{prompt}{response}=", score_pattern=r"(\d)", max_score=9, max_tokens=8)
    batch = items(["3", "33", "4", "12", "7", "3", "1+1"])
    local = Judge(JudgeConfig(checkpoint=str(path), cache="", max_seq_len=64, **rubric))
    mine = local.replies(batch)
    assert local.requests == 6  # "3" twice: asked once
    with JudgeServer(reply=transformers_reply(path)) as server:
        remote = Judge(JudgeConfig(url=server.url, cache="", **rubric))
        theirs = remote.replies(batch)
        assert mine == theirs
        assert remote.score(batch) == local.score(batch)
    grades = local.score(batch)
    assert sum(g is not None for g in grades) >= 3, f"too few replies with a digit: {mine}"
    # A request with its reply longer than max_seq_len is no grade, and the judge says why.
    short = Judge(JudgeConfig(checkpoint=str(path), cache="", max_seq_len=20, **rubric))
    assert short.score(items(["3", "1234567890" * 2]))[1] is None
    assert "raise the judge's max_seq_len" in short.last_error


def test_a_judge_that_is_down_grades_nothing_and_stops_the_job_after_a_few_batches(tmp_path):
    """Unit level: an endpoint nobody serves gives no grades (not zeros), and after
    ``reward.max_failed_batches`` such batches in a row the job stops naming the term."""
    with JudgeServer() as gone:
        url = gone.url
    registry = build_registry()
    terms = (
        '[{name = "correct", fn = "env"}, {name = "short", fn = "judge", config = '
        f'{{url = "{url}", retries = 0, timeout_s = 2, cache = ""}}}}]'
    )
    config = resolve_config(
        registry, selections={"env": "math"},
        overrides=[f"reward.terms={terms}", "reward.max_failed_batches=2"],
    )  # fmt: skip
    judged = RewardTerms(config, registry, ArithmeticTokenizer())
    assert judged._score(1, items(["3"])) == [None]
    assert "Connection" in judged.last_error[1]
    judged._stop_if_failing([[1.0], [None]])
    with pytest.raises(StalledError, match=r"(?s)'short' \(fn judge\).*of 2 batches.*Connection"):
        judged._stop_if_failing([[1.0], [None]])


def test_a_judge_without_an_endpoint_is_refused_before_the_job_starts(cli, tmp_path):
    result = cli(
        "run", "--env", "math", "--set", 'reward.terms=[{name = "j", fn = "judge"}]',
        "--set", f'run_dir="{tmp_path}"',
    )  # fmt: skip
    assert result.exit_code == ExitCode.CONFIG, result.output
    assert "$.reward.terms[0] ('j', fn judge): set config.url" in " ".join(result.output.split())
    assert not any(tmp_path.iterdir())


JOB = [
    "--env", "math",
    "--set", 'curriculum.lessons=[{id = "add", env_config = {task = "add_1digit"}}]',
    "--set", "trainer.batch_size=16", "--set", "sampling.n_prompts=2",
    "--set", "sampling.n_generations_per_prompt=8",
    "--set", "sampling.max_tokens=3", "--set", "eval.sampling.max_tokens=3",
    "--set", "eval.n_examples=4", "--set", "eval.frequency=100",
    "--set", "trainer.checkpoint_interval_steps=1", "--set", "resources.colocate=true",
    "--set", "reward.max_failed_batches=2",
]  # fmt: skip


def _terms(url, cache):
    return (
        'reward.terms=[{name = "correct", fn = "env"}, {name = "short", fn = "judge", '
        f'weight = 0.5, config = {{url = "{url}", retries = 1, timeout_s = 5, cache = "{cache}"}}}}]'
    )


def test_a_job_stops_naming_its_judge_when_it_goes_down_and_resumes_without_asking_twice(
    cli, tmp_path
):
    """The bar: the judge's grades are logged and summed into the reward; the judge dying
    mid-job drops (and counts) what it could not grade, and the job stops naming it; once it is
    back, ``--resume`` finishes the run and no judgment is requested twice."""
    run_dir, cache = tmp_path / "runs", tmp_path / "judge.sqlite"
    with JudgeServer() as first:
        # Then down, every request answered 503: after two steps or so (16 rollouts a batch,
        # at most 16 requests, fewer after dedup; the first eval's 4 too).
        first.answer_budget = 40
        result = cli(
            "run", *JOB, "--set", "trainer.num_train_steps=12", "--set", _terms(first.url, cache),
            "--set", f'run_dir="{run_dir}"', "--run-id", "judged",
        )  # fmt: skip
        port, asked_first = first.port, list(first.bodies)
    out = " ".join(result.output.split())
    assert result.exit_code == ExitCode.STALLED, result.output
    assert "reward term 'short' (fn judge)" in out and "503" in out
    assert f"marinrl run --resume {run_dir / 'judged'}" in out
    assert "Traceback" not in result.output
    run = run_dir / "judged"
    rows = read_metrics(run)
    batches = [r for r in rows if r["source"] == "rollout" and "rollout/reward_failures" in r]
    assert sum(r["rollout/reward_failures"] for r in batches) > 0, "nothing dropped was counted"
    graded = [r for r in batches if "rollout/reward/short" in r]
    assert graded and all(0 <= r["rollout/reward/short"] <= 1 for r in graded)
    trained = [r["step"] for r in rows if r["source"] == "train"]
    assert trained and max(trained) < 12, trained

    with JudgeServer(port=port) as back:  # the same endpoint, up again
        result = cli("run", "--resume", str(run))
        asked_again = list(back.bodies)
    assert result.exit_code == 0, result.output
    assert max(r["step"] for r in read_metrics(run) if r["source"] == "train") == 12
    asked = Counter(asked_first + asked_again)
    assert asked and max(asked.values()) == 1, "a judgment was requested twice"
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    for row in samples[-16:]:
        terms = row["reward_terms"]
        assert row["reward"] == pytest.approx(terms["correct"] + 0.5 * terms["short"])
