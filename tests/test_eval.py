"""``marinrl eval`` (issue 63): any model on any env, several samples a problem, pass@k and maj@k
with 95% intervals, and every sample in ``samples.jsonl``, from which the numbers are recomputed
here by hand."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter

import pytest

from marin_rl_core.eval_stats import majority_correct, pass_at_k, student_t, summarize, wilson
from marin_rl_core.testing import write_tiny_hf_checkpoint


def test_pass_at_k_is_the_chance_that_k_of_the_samples_hold_a_correct_one():
    for n, c, k in [(8, 0, 1), (8, 3, 1), (8, 3, 4), (8, 6, 4), (5, 5, 5), (6, 2, 6)]:
        subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets))
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    with pytest.raises(ValueError, match="need 0 < k <= n"):
        pass_at_k(4, 1, 5)


def test_majority_vote_takes_the_most_common_answer_of_the_first_k():
    answers = ["7", "5", "5", None, "7", "7"]
    correct = [True, False, False, False, True, True]
    assert not majority_correct(answers, correct, 3)  # "5" twice beats "7" once
    assert majority_correct(answers, correct, 6)  # "7" three times
    assert majority_correct(answers, correct, 2)  # a tie: the answer reached first, "7"
    assert not majority_correct([None, None], [False, False], 2)  # no answer: no vote


def test_intervals_are_wilson_for_rates_and_student_t_for_rewards():
    from scipy.stats import t as student  # ~0.6 s: imported where used, not at collection

    est = wilson([1, 0, 1, 1])  # 3 of 4, z = 1.96: the textbook interval
    assert (est.value, round(est.low, 3), round(est.high, 3)) == (0.75, 0.301, 0.954)
    assert wilson([0.0] * 10).low == 0.0 and 0 < wilson([0.0] * 10).high < 0.35
    rewards = [0.0, 0.5, 1.0, 0.25]
    mean, sd = sum(rewards) / 4, math.sqrt(sum((r - 0.4375) ** 2 for r in rewards) / 3)
    half = student.ppf(0.975, 3) * sd / 2
    est = student_t(rewards)
    assert (est.value, est.low, est.high) == pytest.approx((mean, mean - half, mean + half))
    rows = [
        [{"reward": 1.0, "correct": True, "answer": "1"}] * 2,
        [{"reward": 0.0, "correct": False, "answer": None}] * 2,
    ]
    stats = summarize(rows, [1, 2, 4], majority=True)
    assert set(stats) == {"problems", "samples", "reward", "pass@1", "pass@2", "maj@2"}


def recompute(rows, ks):
    """pass@k, maj@k and mean reward per lesson, by hand from samples.jsonl rows."""
    out = {}
    for lesson in dict.fromkeys(r["lesson"] for r in rows):
        problems = {}
        for r in rows:
            if r["lesson"] == lesson:
                problems.setdefault(r["problem"], []).append(r)
        n = min(len(p) for p in problems.values())
        got = {
            "reward": sum(sum(s["reward"] for s in p[:n]) / n for p in problems.values())
            / len(problems)
        }
        for k in ks:
            values = []
            for p in problems.values():
                c = sum(s["correct"] for s in p[:n])
                values.append(1 - math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 1.0)
            got[f"pass@{k}"] = sum(values) / len(values)
            if k > 1:
                wins = 0
                for p in problems.values():
                    votes = Counter(s["answer"] for s in p[:k] if s["answer"] is not None)
                    if votes:
                        top = max(votes.values())
                        winner = next(s["answer"] for s in p[:k] if votes.get(s["answer"]) == top)
                        wins += any(s["answer"] == winner and s["correct"] for s in p[:k])
                got[f"maj@{k}"] = wins / len(problems)
        out[lesson] = got
    return out


def test_eval_of_a_hugging_face_checkpoint_on_a_file_task_reports_what_its_samples_say(
    cli, tmp_path
):
    """The bar, on a tiny checkpoint in SmolLM2's place: ``marinrl eval --model CKPT --env math
    --set env.task=file ... --samples 8 --k 1 --k 4 --k 8`` prints pass@1/4/8 and maj@8 with
    intervals, and the same numbers come out of its samples.jsonl by hand."""
    model = write_tiny_hf_checkpoint(tmp_path / "model", "qwen3", seed=2)
    data = tmp_path / "sums.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
            for a in range(1, 7)
            for b in range(1, 5)
        )
    )
    out = tmp_path / "evals"
    result = cli(
        "eval", "--model", str(model), "--env", "math", "--set", "env.task=file",
        "--set", f'env.data_path="{data}"', "--set", "env.eval_fraction=0.5",
        "--set", "eval.sampling.max_tokens=3", "--set", "sampling.max_tokens=3",
        "--samples", "8", "--k", "1", "--k", "4", "--k", "8", "--n-examples", "6",
        "--temperature", "1.0", "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for name in ("pass@1", "pass@4", "pass@8", "maj@8"):
        assert name in text
    assert "Wilson score" in text and "8 sample(s) a problem at temperature 1" in text
    results = json.loads((out / "results.json").read_text())
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 6 * 8 and {r["sample"] for r in rows} == set(range(8))
    assert all("answer" in r and r["response"] is not None for r in rows)
    (lesson,) = results["lessons"]
    stats = results["lessons"][lesson]["stats"]
    by_hand = recompute(rows, [1, 4, 8])[lesson]
    for name, value in by_hand.items():
        assert stats[name]["value"] == pytest.approx(value), name
        assert stats[name]["low"] <= value <= stats[name]["high"]
    assert results["lessons"][lesson]["correct"] == pytest.approx(
        sum(r["correct"] for r in rows) / len(rows)
    )
    # marinrl samples: what it wrote, the best and the worst first, with their rewards.
    shown = cli("samples", str(out), "--n", "2")
    assert shown.exit_code == 0, shown.output
    best = max(rows, key=lambda r: r["reward"])
    text = " ".join(shown.output.split())
    assert f"{len(rows)} samples" in text and "the best 2 and the worst 2" in text
    assert f"reward {best['reward']:.3f}" in text and "worst" in text
    missing = cli("samples", str(out / "samples.jsonl"), "--step", "7")
    assert missing.exit_code == 3 and "has no samples of step 7" in missing.output
    nothing = cli("samples", str(tmp_path), "--eval")
    assert nothing.exit_code == 3 and "`marinrl eval" in nothing.output


def test_eval_all_scores_every_checkpoint_as_the_run_scored_it(cli, tmp_path, tiny_mock_job):
    """``marinrl eval RUN --all``: a row per checkpoint, a plot, each step's samples; greedy on
    the run's own held-out draw, each checkpoint's score is the one the run logged at its step
    (the last within its interval, as the bar asks, and here exactly)."""
    from marin_rl_core.metrics import read_metrics

    result = cli(
        "run", *tiny_mock_job, "--set", "trainer.num_train_steps=3", "--set", "eval.frequency=1",
        "--set", "trainer.checkpoint_interval_steps=1", "--set", "resources.colocate=true",
        "--set", f'run_dir="{tmp_path}"', "--run-id", "r",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    run = tmp_path / "r"
    evaluated = cli("eval", str(run), "--all", "--json")
    assert evaluated.exit_code == 0, evaluated.output
    found = json.loads(evaluated.stdout[evaluated.stdout.index("{") :])
    steps = [r["step"] for r in found["checkpoints"]]
    assert steps == sorted(steps) and steps[-1] == 3 and len(steps) >= 2
    assert (run / "evals" / "checkpoints.png").stat().st_size > 0
    logged = {r["step"]: r for r in read_metrics(run) if r["source"] == "eval"}
    for r in found["checkpoints"]:
        assert (run / "evals" / f"step-{r['step']:06d}" / "samples.jsonl").is_file()
        for lesson, row in r["lessons"].items():
            assert row["reward"] == pytest.approx(logged[r["step"]][f"eval/{lesson}/reward"])
    last = found["checkpoints"][-1]["overall"]["pass@1"]
    (lesson,) = found["checkpoints"][-1]["lessons"]
    assert last["low"] <= logged[3][f"eval/{lesson}/reward"] <= last["high"]
    table = cli("eval", str(run), "--all")
    assert table.exit_code == 0 and "eval of each checkpoint" in table.output
    # The run kept a few held-out samples of each eval (logging.samples_per_step), to read.
    kept = [json.loads(line) for line in (run / "eval_samples.jsonl").read_text().splitlines()]
    assert {r["step"] for r in kept} == set(logged) and all(r["source"] == "eval" for r in kept)
    shown = cli("samples", str(run), "--eval", "--step", "2")
    assert shown.exit_code == 0, shown.output
    assert "eval_samples.jsonl: step 2, " in shown.output
    # The run's policy on other lessons: --set over the run's config; its checkpoints untouched.
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    other = cli(
        "eval", str(run), "--json", "--out", str(tmp_path / "other"), "--set",
        'curriculum.lessons=[{id = "longer", env_config = {min_items = 5, max_items = 6}}]',
    )  # fmt: skip
    assert other.exit_code == 0, other.output
    assert list(json.loads(other.stdout[other.stdout.index("{") :])["lessons"]) == ["longer"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_an_eval_that_cannot_write_its_results_says_so_before_sampling(cli, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # --out under a file: nothing can be written there
    model = write_tiny_hf_checkpoint(tmp_path / "model", "qwen3")
    result = cli("eval", "--model", str(model), "--env", "math", "--out", str(blocked / "out"))
    assert result.exit_code == 3, result.output
    assert (
        "cannot write the eval's results to" in result.output and "Traceback" not in result.output
    )
