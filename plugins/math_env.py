"""The ``math`` env: arithmetic problems generated in code, or math problems from data.

Generated tasks (prompt -> answer), graded by exact match of the whole response:

===============  ===========================  =========
task             problems                     example
===============  ===========================  =========
``add_small``    ``a+b``, a, b in 0..4        ``3+4=``  -> ``7``
``add_1digit``   ``a+b``, a, b in 0..9        ``8+5=``  -> ``13``
``sub_1digit``   ``a-b``, 0 <= b <= a <= 9    ``9-4=``  -> ``5``
``mul_small``    ``a*b``, a, b in 0..4        ``3*4=``  -> ``12``
``mul_1digit``   ``a*b``, a, b in 0..9        ``7*8=``  -> ``56``
``add_2digit``   ``a+b``, a, b in 10..99      ``23+45=`` -> ``68``
===============  ===========================  =========

Problems from data, graded with ``math-verify`` (two ways to name them):

* ``task = "file"`` reads one local JSONL or Parquet file, ``data_path`` (and ``eval_data_path``
  for eval, if given).
* ``task = "dataset"`` reads ``dataset``: a Hugging Face ``datasets`` name (``"openai/gsm8k"``,
  with ``dataset_config = "main"``) or a local directory of ``.jsonl``/``.parquet`` files
  (``train.jsonl``, ``test.jsonl`` ...; file names give the split names), loaded with
  ``datasets.load_dataset`` when the env is built. ``train_split`` is trained on and
  ``eval_split`` evaluated; an empty ``eval_split`` holds out ``eval_fraction`` of the train
  split. A hub name needs network access (or the Hugging Face cache) when the env is built;
  without it the env raises a ``ValueError`` that says how to pass a local copy instead.

``question_field`` and ``answer_field`` name the columns. The reference answer is the answer
column after ``answer_extraction``, and the policy's answer is its response after ``extract``:

===============  ==============================================================================
extraction       what it takes
===============  ==============================================================================
``boxed``        the contents of the last complete ``\\boxed{...}`` (nested braces allowed)
``hash``         what follows the last ``####`` on its line (GSM8K's ``#### 42``)
``last_number``  the last number: ``-3``, ``0.25``, ``1,600``
``auto``         ``boxed`` if there is one, else ``hash``, else: for ``extract``, the last
                 number; for ``answer_extraction``, the whole text (a bare ``42`` or ``0.5``)
``none``         the whole text (``math-verify`` finds an answer in it as best it can)
===============  ==============================================================================

Both default to ``auto``, which reads GSM8K's ``... #### 42`` solutions, MATH's ``\\boxed{}``
ones and bare answers alike. A reference that ``answer_extraction`` (other than ``auto`` and
``none``) finds no answer in stops the env before training, naming the row.

``score`` returns a :class:`~marin_rl_core.Score` with two metrics, logged as
``rollout/score/<name>`` and ``eval/<lesson>/<name>``: ``format`` (1 when ``extract`` found an
answer in the requested form; with ``none``, when ``math-verify`` found one) and ``correct``
(1 when ``math-verify`` says the answer equals the reference). The reward is ``correct``; in
training a well-formed but wrong answer earns ``format_reward`` (default 0) instead of 0, a
shaping term that teaches the answer format before the answers. Eval reward is always
``correct``.

Held-out split (``mode="train"`` never returns an eval problem), ``round(eval_fraction * N)``
problems of ``N``:

* ``split = "swap"`` (commutative tasks: add, mul): unordered pairs ``{a, b}`` with ``a != b`` are
  ordered by a salted hash and, for the first ones, one orientation (say ``8+5``) is held out
  while the other (``5+8``) stays in training. Eval then measures whether the policy learned
  the sums it was rewarded for *and* that they do not depend on the order of the operands
  (``bench/supervised_generalization.py`` shows what the tiny default model can infer here).
* ``split = "hash"`` (and non-commutative tasks, files and datasets): problems are ordered by a
  salted hash of their text and the first ones are held out.

A file task with ``eval_data_path``, or a dataset task with ``eval_split``, uses that for eval
instead.

Training reward shaping of generated tasks (train mode only; eval is always exact match): a
response whose leading number is right but which does not end there earns ``partial_credit``.
A policy initialised from scratch puts ~1/167 of its mass on each token, so "answer then EOS"
has probability ~4e-5 and pure exact match gives it no reward to learn from.

Example (GSM8K, once downloaded with ``huggingface-cli download --repo-type dataset
openai/gsm8k --local-dir gsm8k``; ``dataset = "openai/gsm8k"`` loads it from the hub)::

    [env]
    name = "math"
    task = "dataset"
    dataset = "./gsm8k"        # or "openai/gsm8k"
    dataset_config = "main"
    train_split = "train"
    eval_split = "test"
    extract = "auto"
    prompt_template = "{question}\nEnd with '#### <answer>'."
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
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
    Score,
    hookimpl,
    one_of,
)

logger = logging.getLogger(__name__)

ARITHMETIC_TASKS: dict[str, tuple[str, list[tuple[int, int]]]] = {
    "add_small": ("+", [(a, b) for a in range(5) for b in range(5)]),
    "add_1digit": ("+", [(a, b) for a in range(10) for b in range(10)]),
    "sub_1digit": ("-", [(a, b) for a in range(10) for b in range(a + 1)]),
    "mul_small": ("*", [(a, b) for a in range(5) for b in range(5)]),
    "mul_1digit": ("*", [(a, b) for a in range(10) for b in range(10)]),
    "add_2digit": ("+", [(a, b) for a in range(10, 100) for b in range(10, 100)]),
}
TASKS = (*ARITHMETIC_TASKS, "file", "dataset")
COMMUTATIVE_OPS = ("+", "*")
SPLITS = ("swap", "hash")
EXTRACTIONS = ("auto", "boxed", "hash", "last_number", "none")
_LEADING_NUMBER = re.compile(r"-?[0-9]+")
_BOXED = re.compile(r"\\boxed\s*\{")
_HASH = re.compile(r"####[ \t]*([^\n]*)")
# A minus sign belongs to the number unless it follows a digit, letter or ")" ("5-3" is 5 and 3).
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


@attrs.frozen(kw_only=True)
class MathEnvConfig:
    """Args:
    task: which problems (see the module docstring); ``"file"`` reads ``data_path``,
        ``"dataset"`` reads ``dataset``.
    eval_fraction: the share of problems held out for eval.
    split: ``"swap"`` or ``"hash"``: how the held-out problems are chosen (module docstring).
    split_seed: salts the hash that decides the held-out split.
    data_path: a ``.jsonl`` or ``.parquet`` file of problems (``task = "file"``).
    eval_data_path: a separate file of eval problems; empty holds out ``eval_fraction`` of
        ``data_path``.
    dataset: a Hugging Face ``datasets`` name (``"openai/gsm8k"``) or a local directory of
        ``.jsonl``/``.parquet`` files (``task = "dataset"``).
    dataset_config: the dataset's configuration name (``"main"`` for GSM8K); empty for none.
    train_split: the split trained on.
    eval_split: the split evaluated; empty holds out ``eval_fraction`` of ``train_split``.
    question_field: the column holding the question text.
    answer_field: the column holding the reference answer (or a solution ending in it).
    answer_extraction: how the reference answer is taken from ``answer_field``: ``"auto"``,
        ``"boxed"``, ``"hash"``, ``"last_number"`` or ``"none"`` (module docstring).
    extract: how the policy's answer is taken from its response, the same choices.
    format_reward: training reward of a well-formed (``extract`` found an answer) but wrong
        answer to a file or dataset problem; eval reward is correctness only.
    prompt_template: how a question becomes the prompt; ``{question}`` is replaced.
    grading_timeout_s: the longest ``math-verify`` may take over one response (it runs in a
        grader process of its own, killed and replaced when it overruns); a response whose
        grading overruns is wrong, and the env logs it.
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
    dataset: str = ""
    dataset_config: str = ""
    train_split: str = "train"
    eval_split: str = "test"
    question_field: str = "question"
    answer_field: str = "answer"
    answer_extraction: str = attrs.field(default="auto", validator=one_of(*EXTRACTIONS))
    extract: str = attrs.field(default="auto", validator=one_of(*EXTRACTIONS))
    format_reward: float = attrs.field(
        default=0.0, validator=[attrs.validators.ge(0.0), attrs.validators.lt(1.0)]
    )
    prompt_template: str = "{question}"
    grading_timeout_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0.0))
    partial_credit: float = attrs.field(
        default=0.5, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)]
    )

    def __attrs_post_init__(self) -> None:
        if self.task == "file" and not self.data_path:
            raise ValueError('math task "file" needs data_path (a .jsonl or .parquet file)')
        if self.task == "dataset":
            if not self.dataset:
                raise ValueError(
                    'math task "dataset" needs dataset: a Hugging Face datasets name such as '
                    '"openai/gsm8k", or a local directory of .jsonl/.parquet files'
                )
            if not self.train_split:
                raise ValueError('math task "dataset" needs train_split (such as "train")')
            if self.eval_split == self.train_split:
                raise ValueError(
                    f"eval_split and train_split are both {self.train_split!r}, so eval would "
                    'score training problems; set eval_split = "" to hold out eval_fraction of it'
                )


def _split_rank(text: str, seed: int) -> bytes:
    return hashlib.sha256(f"{seed}:{text}".encode()).digest()


def _hold_out(
    problems: list[Problem], fraction: float, seed: int
) -> tuple[list[Problem], list[Problem]]:
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


def _split_by_ids(
    problems: list[Problem], eval_ids: set[str]
) -> tuple[list[Problem], list[Problem]]:
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


def read_problem_file(
    path: str | Path, *, question_field: str, answer_field: str
) -> list[dict[str, Any]]:
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


def read_dataset_split(
    dataset: str, *, config_name: str, split: str, question_field: str, answer_field: str
) -> list[dict[str, Any]]:
    """Rows of one split of a Hugging Face dataset (a hub name or a local directory of data
    files, loaded with ``datasets.load_dataset``) with ``question_field`` and ``answer_field``."""
    import datasets

    local = Path(dataset).expanduser()
    is_local = dataset.startswith(("/", "./", "../", "~")) or local.exists()
    if is_local and not local.exists():
        raise ValueError(f"math dataset directory {dataset!r} does not exist")
    try:
        data = datasets.load_dataset(
            str(local) if is_local else dataset, config_name or None, split=split
        )
    except Exception as exc:
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        if len(reason) > 300:
            reason = reason[:300] + " ..."
        where = f"{dataset!r}" + (f" (config {config_name!r})" if config_name else "")
        fix = (
            "check that it holds .jsonl or .parquet files whose names give the split names "
            f"(such as {split}.jsonl)"
            if is_local
            else "to run without the Hugging Face Hub, pass a local path instead: download it "
            "where there is network (huggingface-cli download --repo-type dataset "
            f'{dataset} --local-dir DIR), copy DIR over and set dataset = "DIR" (any '
            'directory of .jsonl/.parquet files works), or set task = "file" and data_path to '
            "one .jsonl/.parquet file"
        )
        raise ValueError(
            f"math dataset {where} split {split!r} could not be loaded ({reason}); {fix}"
        ) from exc
    missing = [f for f in (question_field, answer_field) if f not in data.column_names]
    if missing:
        raise ValueError(
            f"math dataset {dataset!r} split {split!r} has no {missing[0]!r} column (it has "
            f"{', '.join(data.column_names)}); set question_field/answer_field to the column names"
        )
    return data.select_columns(list(dict.fromkeys([question_field, answer_field]))).to_list()


def last_boxed(text: str) -> str | None:
    """The contents of the last complete ``\\boxed{...}`` in ``text`` (braces balanced)."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth = 1
        for end in range(match.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                return text[match.end() : end].strip() or None
    return None


def extract_answer(text: str, how: str) -> str | None:
    """The answer in ``text`` the way ``how`` (an ``extract`` mode) takes it; ``None`` when it
    is not there. ``"auto"``: boxed, else ``####``, else the last number."""
    if how == "none":
        return text.strip() or None
    if how in ("boxed", "auto") and (boxed := last_boxed(text)) is not None:
        return boxed
    if how in ("hash", "auto"):
        hashes = [m.group(1).strip().rstrip(".").strip() for m in _HASH.finditer(text)]
        if hashes and hashes[-1]:
            return hashes[-1]
    if how in ("last_number", "auto"):
        numbers = _NUMBER.findall(text)
        if numbers:
            return numbers[-1]
    return None


def reference_answer(text: str, how: str) -> str | None:
    """The reference answer in an answer column: like :func:`extract_answer`, except that
    ``"auto"`` falls back to the whole text (``"42"``, ``"\\frac{1}{2}"``) rather than its
    last number."""
    if how == "auto":
        return extract_answer(text, "boxed") or extract_answer(text, "hash") or text.strip() or None
    return extract_answer(text, how)


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
        elif config.task == "dataset":
            train = self._dataset_problems(config.train_split)
            if config.eval_split:
                eval_ = self._dataset_problems(config.eval_split)
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
        return self._data_problems(rows, id_prefix=Path(path).stem, source=repr(path))

    def _dataset_problems(self, split: str) -> list[Problem]:
        c = self.config
        rows = read_dataset_split(
            c.dataset,
            config_name=c.dataset_config,
            split=split,
            question_field=c.question_field,
            answer_field=c.answer_field,
        )
        return self._data_problems(
            rows,
            id_prefix=f"{dataset_lesson_id(c.dataset)}:{split}",
            source=f"{c.dataset!r} split {split!r}",
        )

    def _data_problems(
        self, rows: list[dict[str, Any]], *, id_prefix: str, source: str
    ) -> list[Problem]:
        c = self.config
        problems = []
        for i, row in enumerate(rows):
            text = str(row[c.answer_field])
            answer = reference_answer(text, c.answer_extraction)
            if answer is None:
                raise ValueError(
                    f"{source} row {i}: answer_extraction = {c.answer_extraction!r} finds no "
                    f"answer in {c.answer_field!r} ({text[-80:]!r}); set answer_extraction to "
                    'how the answers are written, or "none" to take the whole column'
                )
            problems.append(
                Problem(
                    id=f"{id_prefix}:{i}",
                    prompt=c.prompt_template.format(question=str(row[c.question_field])),
                    answer=answer,
                    info={"task": c.task},
                )
            )
        return problems

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

    def answer(self, problem: Problem, response: str) -> str | None:
        """The response's answer, for ``marinrl eval``'s majority vote: generated tasks grade
        the whole response (exact match), so it is the answer; file and dataset tasks: what
        ``extract`` takes from it, a number written canonically (``"1,000.50"`` and
        ``"1000.5"`` agree)."""
        if problem.info.get("task") not in ("file", "dataset"):
            return response or None
        found = extract_answer(response, self.config.extract)
        if found is None:
            return None
        try:
            number = Decimal(found.replace(",", "").strip())
        except InvalidOperation:
            return " ".join(found.split())
        return format(number.normalize(), "f") if number.is_finite() else " ".join(found.split())

    def score(self, problem: Problem, response: str) -> float | Score:
        """Generated tasks: exact match (a float). File and dataset tasks: a :class:`Score`
        with ``format`` and ``correct`` (module docstring)."""
        if problem.info.get("task") in ("file", "dataset"):
            well_formed, correct = _GRADER.grade(
                problem.answer, response, self.config.extract, self.config.grading_timeout_s
            )
            if correct:
                reward = 1.0
            elif well_formed and problem.info.get("mode") == "train":
                reward = self.config.format_reward
            else:
                reward = 0.0
            return Score(reward, {"format": float(well_formed), "correct": float(correct)})
        if response == problem.answer:
            return 1.0
        if problem.info.get("mode") == "train" and self.config.partial_credit > 0:
            leading = _LEADING_NUMBER.match(response)
            if leading is not None and leading.group(0) == problem.answer:
                return self.config.partial_credit
        return 0.0


class BoundedGrader:
    """Runs :func:`grade_response` in a grader process of its own, so that every grade has a
    bounded time in any thread (``math-verify``'s own timeouts use SIGALRM, which works only in
    a process's main thread, and rollout workers score in other threads).

    The process (``python -m marin_rl_plugins.math_env``) starts on first use and answers one
    JSON line per JSON line; one that overruns ``timeout`` is killed and replaced on the next
    grade. Thread-safe: grades are serialised.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: Any = None
        self.timeouts = 0
        self._last_warning = -1e9

    def _start(self) -> Any:
        import subprocess
        import sys

        return subprocess.Popen(
            [sys.executable, "-m", "marin_rl_plugins.math_env"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
        )

    def grade(
        self, reference: str, response: str, extract: str, timeout: float
    ) -> tuple[bool, bool]:
        """``grade_response(reference, response, extract)``; after ``timeout`` seconds the
        response is wrong (well-formed if ``extract`` found an answer in it)."""
        import select
        import time

        request = (json.dumps([reference, response, extract]) + "\n").encode()
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            deadline = time.monotonic() + timeout
            try:
                proc.stdin.write(request)
                line = b""
                while not line.endswith(b"\n"):
                    left = deadline - time.monotonic()
                    if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                        raise TimeoutError
                    chunk = os.read(proc.stdout.fileno(), 1 << 16)
                    if not chunk:
                        raise BrokenPipeError("the grader process ended")
                    line += chunk
                well_formed, correct = json.loads(line)
                return bool(well_formed), bool(correct)
            except (TimeoutError, OSError, ValueError) as exc:
                proc.kill()
                proc.wait()
                self._proc = None
                self.timeouts += isinstance(exc, TimeoutError)
                now = time.monotonic()
                if now - self._last_warning > 60:  # at most one warning a minute
                    self._last_warning = now
                    logger.warning(
                        "grading a response took longer than %g s (grading_timeout_s) or failed "
                        "(%s); it counts as wrong. %d timeouts so far. Response: %.200r",
                        timeout,
                        type(exc).__name__,
                        self.timeouts,
                        response,
                    )
                answer = None if extract == "none" else extract_answer(response, extract)
                return answer is not None, False


_GRADER = BoundedGrader()


def _serve_grades() -> None:
    """The grader process: one ``[reference, response, extract]`` JSON line in, one
    ``[well_formed, correct]`` line out, until stdin closes."""
    import sys

    for line in sys.stdin:
        reference, response, extract = json.loads(line)
        well_formed, correct = grade_response(reference, response, extract)
        sys.stdout.write(json.dumps([well_formed, correct]) + "\n")
        sys.stdout.flush()


def grade_response(reference: str, response: str, extract: str) -> tuple[bool, bool]:
    """``(well_formed, correct)``: whether ``extract`` finds an answer in ``response`` (with
    ``"none"``: whether ``math-verify`` does), and whether ``math-verify`` finds it equal to
    ``reference``. Unbounded in a thread other than the main one: use :class:`BoundedGrader`."""
    from math_verify import parse, verify

    # math-verify times out with SIGALRM, which only the main thread may use.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    if extract == "none":
        pred = parse(response, parsing_timeout=timeout)
        if not pred:
            return False, False
    else:
        answer = extract_answer(response, extract)
        if answer is None:
            return False, False
        pred = _parse_answer(answer, timeout)
    gold = _parse_answer(reference, timeout)
    if not gold or not pred:
        return True, False
    return True, bool(verify(gold, pred, timeout_seconds=timeout))


def _parse_answer(answer: str, timeout: int | None) -> list[Any]:
    """``math-verify``'s reading of a bare answer. Boxed first, since bare LaTeX (``\\sqrt{2}``,
    ``x^2+1``) parses to nothing and ``2, 3`` to its last number; the plain text when the box
    gives no expression (``5.``)."""
    from math_verify import parse

    boxed = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)
    if boxed and not isinstance(boxed[0], str):
        return boxed
    return parse(answer, parsing_timeout=timeout) or boxed


def dataset_lesson_id(dataset: str) -> str:
    """A short name for a dataset: its last path part (``openai/gsm8k`` -> ``gsm8k``)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(dataset.rstrip("/\\")).name).strip("._")
    return name or "dataset"


def default_lessons(config: MathEnvConfig) -> Sequence[LessonConfig]:
    """``add_1digit`` first; ``mul_small`` (times tables to 4) once it is mostly learned (held-out
    eval >= 0.8), then ``mul_1digit``; subtraction and two-digit addition once addition is
    mastered (>= 0.95, its stop threshold). The tiny default model learns ``mul_small`` within
    the default 2000 steps, so the default run shows the curriculum moving on; held out by
    ``swap`` like addition, it asks for the same kind of generalisation. ``sub_1digit`` (held out
    by hash: unseen pairs) and ``add_2digit`` need a bigger model (docs/default-task.md). A file
    task is one lesson, ``file``; a dataset task is one lesson named for the dataset
    (``gsm8k``)."""
    if config.task == "file":
        return [LessonConfig(id="file", env_config={"task": "file"})]
    if config.task == "dataset":
        return [LessonConfig(id=dataset_lesson_id(config.dataset), env_config={"task": "dataset"})]
    return [
        LessonConfig(id="add_1digit", env_config={"task": "add_1digit"}, stop_threshold=0.95),
        LessonConfig(
            id="mul_small",
            env_config={"task": "mul_small"},
            dependencies=(LessonDependency(lesson="add_1digit", reward_threshold=0.8),),
            # 8 held-out problems: 7 of 8 right is 0.875.
            stop_threshold=0.85,
        ),
        LessonConfig(
            id="sub_1digit",
            env_config={"task": "sub_1digit"},
            dependencies=(LessonDependency(lesson="add_1digit", reward_threshold=0.95),),
            stop_threshold=0.95,
        ),
        LessonConfig(
            id="mul_1digit",
            env_config={"task": "mul_1digit"},
            dependencies=(LessonDependency(lesson="mul_small", reward_threshold=0.85),),
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


def preflight(config: MathEnvConfig) -> list[str]:
    """A file task's files exist (checked before the job starts; see ``EnvPlugin.preflight``)."""
    problems = []
    if config.task == "file":
        for key in ("data_path", "eval_data_path"):
            path = getattr(config, key)
            if path and "://" not in path and not Path(path).expanduser().is_file():
                problems.append(
                    f"env.{key} {path!r} does not exist (looked in "
                    f"{Path(path).expanduser().absolute()}); give the path of a .jsonl or "
                    ".parquet file of problems"
                )
    return problems


@hookimpl
def marinrl_register_envs():
    yield EnvPlugin(
        name="math",
        summary="Arithmetic generated in code (add_1digit ...) or math problems from a file or dataset.",
        config_class=MathEnvConfig,
        build=MathEnv,
        default_lessons=default_lessons,
        preflight=preflight,
    )


if __name__ == "__main__":
    _serve_grades()
