"""The ``math`` env: arithmetic problems generated in code, or math problems from a local file.

Generated tasks (prompt -> answer), graded by exact match of the whole response:

===============  ===========================  =========
task             problems                     example
===============  ===========================  =========
``add_small``    ``a+b``, a, b in 0..4        ``3+4=``  -> ``7``
``add_1digit``   ``a+b``, a, b in 0..9        ``8+5=``  -> ``13``
``sub_1digit``   ``a-b``, 0 <= b <= a <= 9    ``9-4=``  -> ``5``
``mul_1digit``   ``a*b``, a, b in 0..9        ``7*8=``  -> ``56``
``add_2digit``   ``a+b``, a, b in 10..99      ``23+45=`` -> ``68``
===============  ===========================  =========

``task = "file"`` reads problems from a local JSONL or Parquet file (``data_path``; the
question and answer columns are configurable) and grades with ``math-verify``.

Held-out split (``mode="train"`` never returns an eval problem), ``round(eval_fraction * N)``
problems of ``N``:

* ``split = "swap"`` (commutative tasks: add, mul): unordered pairs ``{a, b}`` with ``a != b`` are
  ordered by a salted hash and, for the first ones, one orientation (say ``8+5``) is held out
  while the other (``5+8``) stays in training. Eval then measures whether the policy learned
  the sums it was rewarded for *and* that they do not depend on the order of the operands
  (``bench/supervised_generalization.py`` shows what the tiny default model can infer here).
* ``split = "hash"`` (and non-commutative tasks): problems are ordered by a salted hash of their
  text and the first ones are held out.

A file task with ``eval_data_path`` uses that file for eval instead.

Training reward shaping (train mode only; eval is always exact match): a response whose leading
number is right but which does not end there earns ``partial_credit``. A policy initialised
from scratch puts ~1/167 of its mass on each token, so "answer then EOS" has probability ~4e-5
and pure exact match gives it no reward to learn from.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from marin_rl_core import (
    EnvPlugin,
    LessonConfig,
    LessonDependency,
    Problem,
    SamplingParams,
    hookimpl,
    one_of,
)

ARITHMETIC_TASKS: dict[str, tuple[str, list[tuple[int, int]]]] = {
    "add_small": ("+", [(a, b) for a in range(5) for b in range(5)]),
    "add_1digit": ("+", [(a, b) for a in range(10) for b in range(10)]),
    "sub_1digit": ("-", [(a, b) for a in range(10) for b in range(a + 1)]),
    "mul_1digit": ("*", [(a, b) for a in range(10) for b in range(10)]),
    "add_2digit": ("+", [(a, b) for a in range(10, 100) for b in range(10, 100)]),
}
TASKS = (*ARITHMETIC_TASKS, "file")
COMMUTATIVE_OPS = ("+", "*")
SPLITS = ("swap", "hash")
_LEADING_NUMBER = re.compile(r"-?[0-9]+")


@attrs.frozen(kw_only=True)
class MathEnvConfig:
    """Args:
    task: which problems (see the module docstring); ``"file"`` reads ``data_path``.
    eval_fraction: the share of problems held out for eval.
    split: ``"swap"`` or ``"hash"``: how the held-out problems are chosen (module docstring).
    split_seed: salts the hash that decides the held-out split.
    data_path: a ``.jsonl`` or ``.parquet`` file of problems (``task = "file"``).
    eval_data_path: a separate file of eval problems; empty holds out ``eval_fraction`` of
        ``data_path``.
    question_field: the column holding the question text.
    answer_field: the column holding the reference answer.
    prompt_template: how a question becomes the prompt; ``{question}`` is replaced.
    partial_credit: training reward of a generated-task response whose leading number is the
        answer but which goes on after it (``"7\\n"``, ``"7cat"``); 0 grades training by exact
        match too. Eval problems are always graded by exact match.
    """

    task: str = attrs.field(default="add_1digit", validator=one_of(*TASKS))
    eval_fraction: float = attrs.field(
        default=0.3, validator=[attrs.validators.gt(0.0), attrs.validators.lt(1.0)]
    )
    split: str = attrs.field(default="swap", validator=one_of(*SPLITS))
    split_seed: int = 0
    data_path: str = ""
    eval_data_path: str = ""
    question_field: str = "question"
    answer_field: str = "answer"
    prompt_template: str = "{question}"
    partial_credit: float = attrs.field(
        default=0.5, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)]
    )

    def __attrs_post_init__(self) -> None:
        if self.task == "file" and not self.data_path:
            raise ValueError('math task "file" needs data_path (a .jsonl or .parquet file)')


def _split_rank(text: str, seed: int) -> bytes:
    return hashlib.sha256(f"{seed}:{text}".encode()).digest()


def _hold_out(problems: list[Problem], fraction: float, seed: int) -> tuple[list[Problem], list[Problem]]:
    """``(train, eval)``: the ``fraction`` of problems with the smallest salted hash are eval."""
    ordered = sorted(problems, key=lambda p: _split_rank(p.prompt + "\x00" + p.answer, seed))
    n_eval = max(1, round(fraction * len(ordered)))
    if n_eval >= len(ordered):
        raise ValueError(f"eval_fraction={fraction} leaves no training problems of {len(ordered)}")
    return _split_by_ids(problems, {p.id for p in ordered[:n_eval]})


def _hold_out_swapped(
    problems: list[Problem], fraction: float, seed: int
) -> tuple[list[Problem], list[Problem]]:
    """``(train, eval)`` where each eval problem ``a op b`` has ``b op a`` in training."""
    by_operands = {(p.info["a"], p.info["b"]): p for p in problems}
    pairs = sorted(
        {tuple(sorted(k)) for k in by_operands if k[0] != k[1] and k[::-1] in by_operands},
        key=lambda k: _split_rank(f"{k[0]},{k[1]}", seed),
    )
    n_eval = max(1, round(fraction * len(problems)))
    if n_eval > len(pairs):
        raise ValueError(
            f"eval_fraction={fraction} asks for {n_eval} held-out problems but only {len(pairs)} "
            'can be held out with their swap in training; lower it or use split = "hash"'
        )
    held_out = set()
    for a, b in pairs[:n_eval]:
        flip = _split_rank(f"{a},{b}:orientation", seed)[0] % 2
        held_out.add(by_operands[(b, a) if flip else (a, b)].id)
    return _split_by_ids(problems, held_out)


def _split_by_ids(problems: list[Problem], eval_ids: set[str]) -> tuple[list[Problem], list[Problem]]:
    return [p for p in problems if p.id not in eval_ids], [p for p in problems if p.id in eval_ids]


def arithmetic_problems(task: str) -> list[Problem]:
    """Every problem of a generated task, in a fixed order."""
    op, pairs = ARITHMETIC_TASKS[task]
    results = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}[op]
    return [
        Problem(
            id=f"{task}:{a}{op}{b}",
            prompt=f"{a}{op}{b}=",
            answer=str(results(a, b)),
            info={"task": task, "a": a, "b": b},
        )
        for a, b in pairs
    ]


def read_problem_file(path: str | Path, *, question_field: str, answer_field: str) -> list[dict[str, Any]]:
    """Rows of a JSONL or Parquet file as dicts with ``question_field`` and ``answer_field``."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"math data file {str(path)!r} does not exist")
    if path.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        raise ValueError(f"math data file {str(path)!r}: use a .jsonl or .parquet file")
    for i, row in enumerate(rows):
        for field in (question_field, answer_field):
            if field not in row:
                raise ValueError(
                    f"{str(path)!r} row {i} has no {field!r} field (it has {', '.join(map(str, row))}); "
                    "set question_field/answer_field to the column names"
                )
    return rows


class MathEnv:
    """Implements :class:`marin_rl_core.Env`; see the module docstring."""

    def __init__(self, config: MathEnvConfig):
        self.config = config
        if config.task == "file":
            train = self._file_problems(config.data_path)
            if config.eval_data_path:
                eval_ = self._file_problems(config.eval_data_path)
            else:
                train, eval_ = _hold_out(train, config.eval_fraction, config.split_seed)
        else:
            problems = arithmetic_problems(config.task)
            if config.split == "swap" and ARITHMETIC_TASKS[config.task][0] in COMMUTATIVE_OPS:
                train, eval_ = _hold_out_swapped(problems, config.eval_fraction, config.split_seed)
            else:
                train, eval_ = _hold_out(problems, config.eval_fraction, config.split_seed)
        # The mode travels with the problem so that `score` grades eval strictly.
        self._splits = {
            mode: [attrs.evolve(p, info={**p.info, "mode": mode}) for p in problems]
            for mode, problems in (("train", train), ("eval", eval_))
        }

    def _file_problems(self, path: str) -> list[Problem]:
        c = self.config
        rows = read_problem_file(path, question_field=c.question_field, answer_field=c.answer_field)
        return [
            Problem(
                id=f"{Path(path).stem}:{i}",
                prompt=c.prompt_template.format(question=str(row[c.question_field])),
                answer=str(row[c.answer_field]),
                info={"task": "file"},
            )
            for i, row in enumerate(rows)
        ]

    def problems(self, mode: str) -> list[Problem]:
        """Every problem of a split (``"train"`` or ``"eval"``)."""
        try:
            return list(self._splits[mode])
        except KeyError:
            raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}") from None

    def sample_problems(self, n: int, *, mode: str, seed: int) -> list[Problem]:
        """``n`` problems of the split, drawn without replacement in a seeded order. Training
        cycles (each problem comes up once before any comes up twice); eval returns each held-out
        problem at most once, so asking for more than the split holds scores all of it."""
        if mode not in self._splits:
            raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
        pool = self._splits[mode]
        if mode == "eval":
            n = min(n, len(pool))
        rng = np.random.default_rng([seed, 0 if mode == "train" else 1])
        out: list[Problem] = []
        while len(out) < n:
            out.extend(pool[i] for i in rng.permutation(len(pool))[: n - len(out)])
        return out

    def score(self, problem: Problem, response: str) -> float:
        if problem.info.get("task") == "file":
            return _math_verify_score(problem.answer, response)
        if response == problem.answer:
            return 1.0
        if problem.info.get("mode") == "train" and self.config.partial_credit > 0:
            leading = _LEADING_NUMBER.match(response)
            if leading is not None and leading.group(0) == problem.answer:
                return self.config.partial_credit
        return 0.0


def _math_verify_score(answer: str, response: str) -> float:
    from math_verify import parse, verify

    # math-verify times out with SIGALRM, which only the main thread may use.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(answer, parsing_timeout=timeout)
    pred = parse(response, parsing_timeout=timeout)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0


def default_lessons(config: MathEnvConfig) -> Sequence[LessonConfig]:
    """``add_1digit`` first; subtraction and two-digit addition unlock once it is mastered
    (held-out eval >= 0.95, its stop threshold), multiplication once subtraction is mostly solved.
    A tiny model shares its capacity between lessons: unlocked earlier (at 0.9), the new
    lessons pulled add_1digit's held-out accuracy from 0.9 back to 0.7. A file task is one
    lesson."""
    if config.task == "file":
        return [LessonConfig(id="file", env_config={"task": "file"})]
    return [
        LessonConfig(id="add_1digit", env_config={"task": "add_1digit"}, stop_threshold=0.95),
        LessonConfig(
            id="sub_1digit",
            env_config={"task": "sub_1digit"},
            dependencies=(LessonDependency(lesson="add_1digit", reward_threshold=0.95),),
            stop_threshold=0.95,
        ),
        LessonConfig(
            id="mul_1digit",
            env_config={"task": "mul_1digit"},
            dependencies=(LessonDependency(lesson="sub_1digit", reward_threshold=0.9),),
            stop_threshold=0.9,
        ),
        LessonConfig(
            id="add_2digit",
            env_config={"task": "add_2digit"},
            # Sums of 100 and more are two tokens ("19", "8"), plus the stop token.
            sampling=SamplingParams(temperature=1.5, max_tokens=3),
            dependencies=(LessonDependency(lesson="add_1digit", reward_threshold=0.95),),
            stop_threshold=0.9,
        ),
    ]


@hookimpl
def marinrl_register_envs():
    yield EnvPlugin(
        name="math",
        summary="Arithmetic generated in code (add_1digit ...) or math problems from a local file.",
        config_class=MathEnvConfig,
        build=MathEnv,
        default_lessons=default_lessons,
    )
