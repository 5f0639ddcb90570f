"""The ``code`` env: HumanEval problems graded by their tests in a sandbox that attacks cannot
get out of, stdin/stdout problems from a local file, multi-turn repair, and a run end to end."""

from __future__ import annotations

import asyncio
import json
import os
import socket

import pytest
from marin_rl_plugins.code_env import CodeEnv, CodeEnvConfig, humaneval_rows
from marin_rl_plugins.code_sandbox import ATTACKS, ESCAPE_FILE

from marin_rl_core import Action


@pytest.fixture(scope="module")
def env() -> CodeEnv:
    return CodeEnv(CodeEnvConfig(eval_fraction=0.25, cpu_seconds=2, wall_seconds=4))


@pytest.fixture(scope="module")
def solutions() -> dict[str, str]:
    return {row["task_id"]: row["canonical_solution"] for row in humaneval_rows()}


def attempt(env: CodeEnv, problem, *responses: str):
    """Play ``responses`` as one episode's attempts; return the steps."""

    async def play():
        episode = env.reset(problem)
        return [await episode.step(Action(text=r, turn=i)) for i, r in enumerate(responses)]

    return asyncio.run(play())


def sandbox_processes() -> list[int]:
    """Processes still running in (deleted) sandbox directories: what an escape leaves."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if "marinrl-sandbox-" in os.readlink(f"/proc/{pid}/cwd"):
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_humaneval_is_built_in_split_and_its_canonical_solutions_pass(env, solutions):
    train = env.sample_problems(200, mode="train", seed=0)
    held_out = env.sample_problems(200, mode="eval", seed=0)
    assert len(env.train_problems) + len(held_out) == 164 and 30 <= len(held_out) <= 50
    assert not {p.id for p in train} & {p.id for p in held_out}
    assert env.sample_problems(200, mode="train", seed=0) == train  # the seed decides

    async def grade_all(problems, responses):
        return await asyncio.gather(
            *[env.reset(p).step(Action(text=r)) for p, r in zip(problems, responses)]
        )

    problems = held_out[:12]
    # HumanEval's own form (the body completing the prompt) and a chat model's (the whole
    # function in a fenced block, without the prompt's imports).
    completions = [solutions[p.id] for p in problems]
    fenced = [
        "Here it is:\n```python\n"
        + "".join(
            line
            for line in p.info["code"].splitlines(keepends=True)
            if not line.startswith(("from ", "import "))
        )
        + solutions[p.id]
        + "\n```\nDone."
        for p in problems
    ]
    for steps in (
        asyncio.run(grade_all(problems, completions)),
        asyncio.run(grade_all(problems, fenced)),
    ):
        assert [s.reward for s in steps] == [1.0] * len(problems)
        assert all(
            s.done and s.metrics["passed"] == 1 and s.metrics["pass_fraction"] == 1 for s in steps
        )


def test_wrong_code_earns_nothing_and_its_failures_are_told_apart(env):
    problem = next(p for p in env.train_problems + env.eval_problems if p.id == "HumanEval/0")
    name = problem.info["entry_point"]
    cases = {
        "wrong": f"def {name}(numbers, threshold):\n    return False\n",
        "syntax_error": f"def {name}(numbers, threshold:\n    return False\n",
        "crash": "raise SystemExit(3)\n",
        "timeout": f"def {name}(numbers, threshold):\n    while True:\n        pass\n",
    }
    results = {kind: attempt(env, problem, code)[0] for kind, code in cases.items()}
    assert all(s.done and s.reward == 0.0 and s.metrics["passed"] == 0 for s in results.values())
    # Returning False passes the tests that expect False: a fraction, not all.
    assert 0 < results["wrong"].metrics["pass_fraction"] < 1
    for kind in ("syntax_error", "crash", "timeout"):
        assert results[kind].metrics[kind] == 1.0, (kind, results[kind].metrics)
        others = {"syntax_error", "crash", "timeout"} - {kind}
        assert all(results[kind].metrics[o] == 0.0 for o in others)
    assert results["wrong"].metrics["crash"] == results["wrong"].metrics["timeout"] == 0


def test_with_attempts_left_a_failure_is_shown_and_the_fix_is_rewarded(solutions):
    env = CodeEnv(CodeEnvConfig(max_attempts=3))
    problem = next(p for p in env.train_problems + env.eval_problems if p.id == "HumanEval/0")
    first, second = attempt(
        env, problem, "def has_close_elements(numbers, threshold):\n    return False\n",
        solutions[problem.id],
    )  # fmt: skip
    assert not first.done and first.reward == 0.0
    assert "tests passed" in first.observation and "AssertionError" in first.observation
    assert "assert candidate(" in first.observation  # the failing test, as the policy sees it
    assert second.done and second.reward == 1.0 and second.metrics["attempts"] == 2


COUNTED_AS = {"infinite loop": "timeout", "fork bomb": "timeout", "memory hog": "crash"}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_an_attack_is_scored_zero_counted_and_leaves_nothing_running(env, solutions, attack):
    problem = env.eval_problems[0]
    [step] = attempt(env, problem, f"```python\n{ATTACKS[attack]}```")
    assert step.done and step.reward == 0.0 and step.metrics["passed"] == 0
    if attack in COUNTED_AS:
        assert step.metrics[COUNTED_AS[attack]] == 1.0
    assert sandbox_processes() == []
    assert not os.path.exists(ESCAPE_FILE)
    # The pool and this process are unharmed: the next program runs as before.
    assert attempt(env, problem, solutions[problem.id])[0].reward == 1.0


def test_code_cannot_write_outside_its_directory(env, tmp_path):
    if not env.pool.isolation["read_only_fs"]:
        pytest.skip("this machine does not let the sandbox make the file system read-only")
    target = tmp_path / "escaped.txt"
    code = f"open({str(target)!r}, 'w').write('out')\nopen('mine.txt', 'w').write('mine')\n"
    [step] = attempt(env, env.eval_problems[0], code)
    assert step.reward == 0.0 and step.metrics["crash"] == 1.0
    assert not target.exists()


def test_code_cannot_reach_the_network(env):
    if not env.pool.isolation["network"]:
        pytest.skip("this machine does not let the sandbox leave the network")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = (
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "s.sendall(b'escaped')\n"
        )
        [step] = attempt(env, env.eval_problems[0], code)
        server.settimeout(0.5)
        with pytest.raises(TimeoutError):
            server.accept()
    assert step.reward == 0.0 and step.metrics["crash"] == 1.0


def test_attacks_and_solutions_run_at_once_and_only_attacks_fail(env, solutions):
    problems = env.eval_problems[: 2 * len(ATTACKS)]
    responses = [
        f"```python\n{list(ATTACKS.values())[i // 2]}```" if i % 2 else solutions[p.id]
        for i, p in enumerate(problems)
    ]

    async def grade():
        return await asyncio.gather(
            *[env.reset(p).step(Action(text=r)) for p, r in zip(problems, responses)]
        )

    steps = asyncio.run(grade())
    assert [s.reward for s in steps] == [0.0 if i % 2 else 1.0 for i in range(len(problems))]
    assert sandbox_processes() == []


def test_stdin_problems_from_a_local_file_with_renamed_fields(tmp_path):
    rows = [
        {"name": "sum", "question": "Print the sum of two integers on one line.",
         "cases": json.dumps({"inputs": ["1 2\n", "5 -7\n"], "outputs": ["3\n", "-2"]})},
        {"name": "echo", "question": "Print the input back.",
         "cases": [{"input": "hi\n", "output": "hi"}]},
    ]  # fmt: skip
    path = tmp_path / "problems.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    env = CodeEnv(
        CodeEnvConfig(
            dataset=str(path), eval_fraction=0.0,
            fields={"id": "name", "prompt": "question", "tests": "cases"},
        )
    )  # fmt: skip
    problem = next(p for p in env.train_problems if p.id == "sum")
    assert "Print the sum" in problem.prompt and "standard input" in problem.prompt
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    half = "```python\nprint(3)\n```"
    [good] = attempt(env, problem, right)
    [partial] = attempt(env, problem, half)
    assert good.reward == 1.0 and partial.reward == 0.0
    assert partial.metrics["pass_fraction"] == 0.5

    # The same problems as a dataset directory, read by the Hugging Face datasets library.
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(path.read_text())
    by_directory = CodeEnv(
        CodeEnvConfig(
            dataset=str(tmp_path / "data"), eval_fraction=0.0,
            fields={"id": "name", "prompt": "question", "tests": "cases"},
        )
    )  # fmt: skip
    assert [p.id for p in by_directory.train_problems] == ["sum", "echo"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "question": "?"}))
    with pytest.raises(ValueError, match="set fields to the column names"):
        CodeEnv(CodeEnvConfig(dataset=str(bad)))
    with pytest.raises(ValueError, match="does not exist"):
        CodeEnv(CodeEnvConfig(dataset=str(tmp_path / "missing.jsonl")))


def test_a_run_on_a_tiny_checkpoint_grades_in_the_sandbox_end_to_end(cli, tmp_path):
    """``marinrl run --env code`` on a tiny Qwen3: the random policy's code is run, graded and
    counted (it does not compile), and the job finishes."""
    pytest.importorskip("torch")
    from marin_rl_core.metrics import read_metrics
    from marin_rl_core.testing import tiny_chat_tokenizer, write_tiny_hf_checkpoint

    checkpoint = write_tiny_hf_checkpoint(
        tmp_path / "qwen3", "qwen3", template="chatml", max_position_embeddings=256,
        vocab_size=len(tiny_chat_tokenizer("chatml")),
    )  # fmt: skip
    problems = tmp_path / "sums.jsonl"
    problems.write_text(
        "\n".join(
            json.dumps({"id": f"add{k}", "prompt": f"Print {k}+1.", "tests": [{"input": "", "output": str(k + 1)}]})
            for k in range(8)
        )
    )  # fmt: skip
    settings = [
        f'model.checkpoint="{checkpoint}"', "model.max_seq_len=160", "trainer.num_train_steps=2",
        "trainer.batch_size=8",
        "eval.n_examples=2", "eval.frequency=100", f'env.dataset="{problems}"',
        f'run_dir="{tmp_path}"',
    ]  # fmt: skip
    lesson = tmp_path / "lesson.toml"  # short answers: a tiny model writes no real code
    lesson.write_text(
        '[[curriculum.lessons]]\nid = "sums"\nenv = "code"\n'
        "sampling = { temperature = 1.0, max_tokens = 24, n_prompts = 2, n_generations_per_prompt = 4 }\n"
        "eval_sampling = { temperature = 0.0, max_tokens = 24, n_generations_per_prompt = 1 }\n"
    )
    result = cli(
        "run", "--env", "code", "--run-id", "code", "--config", str(lesson),
        *[a for s in settings for a in ("--set", s)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output[-3000:]
    rows = read_metrics(tmp_path / "code")
    assert [r["step"] for r in rows if r["source"] == "train"] == [1, 2]
    batches = [r for r in rows if r["source"] == "rollout" and "rollout/score/passed" in r]
    assert batches and all(r["rollout/env_errors"] == 0 for r in batches)
    graded = [r["rollout/score/syntax_error"] + r["rollout/score/crash"] + r["rollout/score/timeout"]
              + r["rollout/score/pass_fraction"] for r in batches]  # fmt: skip
    assert all(g > 0 for g in graded)  # every batch's programs ran and were counted
    assert all(r["rollout/score/sandbox_seconds"] > 0 for r in batches)
