"""Offline evaluation (``marinrl eval``): a :class:`RolloutManager` on its own, no Ray, no weight
transfer, no storage, on the engine a job would use (issue 63).

What is evaluated is a policy: a run's checkpoint (its config and weights; a LoRA run's
adapters merged into its base), or any Hugging Face checkpoint with a config built as ``marinrl
run`` builds one (``--env``, ``--set``). Each lesson's held-out problems (the run's eval draw:
the same seed, so a run's own last eval scores the same problems) are sampled ``samples`` times
each at ``temperature``; every sample is kept (:func:`sample_rows`), and the statistics of
:mod:`marin_rl_core.eval_stats` are computed per lesson and over all of them. Results go to
``results.json`` and the samples to ``samples.jsonl`` in the output directory (a run's:
``<run>/evals/step-<N>/``, never its checkpoints).

A sample is **correct** when its env reports a ``correct`` metric of 1 (the math env does), else
when its reward reaches ``pass_reward``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from marin_rl_core.config.schema import RLJobConfig
from marin_rl_core.learner.checkpoint import STATE_FILE, resolve_checkpoint, run_config_file
from marin_rl_core.registry import Registry
from marin_rl_core.rollout.worker import EVAL_SEED_OFFSET
from marin_rl_core.rundir import run_path

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class EvalSettings:
    """How ``marinrl eval`` samples and what it reports.

    Args:
        samples: samples per problem.
        ks: the k of pass@k and maj@k (those above ``samples`` are left out).
        temperature: sampling temperature; ``None``: the lesson's eval temperature for one
            sample (greedy by default), 1.0 for several.
        n_examples: held-out problems per lesson (``None``: the run's ``eval.n_examples``).
        pass_reward: the reward at which a sample counts as correct, for an env that reports no
            ``correct`` metric.
    """

    samples: int = 1
    ks: tuple[int, ...] = (1,)
    temperature: float | None = None
    n_examples: int | None = None
    pass_reward: float = 1.0


@attrs.frozen(kw_only=True)
class Policy:
    """A policy to evaluate and where it came from."""

    config: RLJobConfig
    tokenizer: Any
    model: Any
    step: int | None
    source: str
    """A checkpoint directory, or the Hugging Face checkpoint's."""
    run_dir: Path | None = None
    warnings: tuple[str, ...] = ()


def run_policy(
    path: str | Path,
    registry: Registry,
    *,
    files: Sequence[str | Path] = (),
    selections: dict[str, str | None] | None = None,
    overrides: Sequence[str] = (),
) -> Policy:
    """The policy of ``path``: a run directory (its newest checkpoint that can be read; damaged
    newer ones are skipped and named in ``warnings``) or one of its checkpoints. Its config is the
    run's, with ``files``, ``selections`` (``--env``) and ``overrides`` (``--set``) over it: the
    same policy evaluated on other lessons or data."""
    from marin_rl_core.config.loading import resolve_config
    from marin_rl_core.learner.checkpoint import CheckpointError, latest_checkpoint, load_newest
    from marin_rl_core.learner.lora_checkpoint import check_base
    from marin_rl_core.models.lora import trained_policy_like
    from marin_rl_core.models.tokenizer import model_tokenizer

    path = run_path(path)
    if (path / "model.eqx").exists() or (path / STATE_FILE).exists():
        run_dir, candidates = path.parent.parent, [resolve_checkpoint(path)]
    else:
        run_dir, candidates = path, []
    config = resolve_config(
        registry,
        files=[run_config_file(run_dir), *files],
        selections=selections,
        overrides=overrides,
    )
    tokenizer = model_tokenizer(config.model)
    # A LoRA run's adapters belong on the base they name: a changed base is refused first
    # (not taken for a damaged checkpoint).
    newest = candidates[0] if candidates else latest_checkpoint(run_dir)
    if newest is not None:
        check_base(newest, config)
    load = _loader(config, tokenizer, trained_policy_like(config, tokenizer))
    warnings: list[str] = []
    if candidates:  # one checkpoint asked for by name: no falling back
        checkpoint = candidates[0]
        try:
            step, model = load(checkpoint)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {checkpoint} cannot be read ({type(exc).__name__}); it is damaged. "
                f"Give the run directory ({run_dir}) to use its newest intact checkpoint."
            ) from exc
    else:
        found = load_newest(run_dir, load, fallback="evaluated {name} instead")
        if found is None:
            resolve_checkpoint(run_dir)  # raises: no checkpoint
            raise AssertionError("unreachable")
        checkpoint, (step, model), warnings = found
    return Policy(
        config=config,
        tokenizer=tokenizer,
        model=model,
        step=step,
        source=str(checkpoint),
        run_dir=run_dir,
        warnings=tuple(warnings),
    )


def _loader(config: RLJobConfig, tokenizer: Any, like: Any) -> Any:
    from marin_rl_core.learner.checkpoint import read_state
    from marin_rl_core.learner.lora_checkpoint import trained_policy

    def load(checkpoint: Path) -> tuple[int, Any]:
        # A LoRA run's policy is its base with the adapters merged in.
        step = int(read_state(checkpoint)["step"])
        return step, trained_policy(checkpoint, config, tokenizer, like=like)

    return load


def pretrained_policy(config: RLJobConfig) -> Policy:
    """The policy ``model.checkpoint`` names (a Hugging Face checkpoint), as a run would start
    from it."""
    from marin_rl_core.models.build import initial_model
    from marin_rl_core.models.tokenizer import model_tokenizer

    tokenizer = model_tokenizer(config.model)
    model = initial_model(config, tokenizer)
    return Policy(
        config=config, tokenizer=tokenizer, model=model, step=None, source=config.model.checkpoint
    )


def sample_rows(
    manager: Any, lesson_id: str, settings: EvalSettings, *, step: int | None
) -> tuple[list[list[dict[str, Any]]], bool, int]:
    """Every sample of one lesson's held-out problems, one list of rows per problem (problems
    an env or a reward term could not finish are left out: counted in the batch's metrics);
    whether the env says what an answer is (maj@k); how many problems were left out."""
    from marin_rl_core.models.tokenizer import response_stop_ids
    from marin_rl_core.rollout.reward_terms import TERM_METRIC_PREFIX, response_text

    config = manager.config
    sampling = config.eval_sampling_for(manager.lessons[lesson_id])
    temperature = settings.temperature
    if temperature is None:
        temperature = sampling.temperature if settings.samples == 1 else 1.0
    sampling = attrs.evolve(
        sampling, n_generations_per_prompt=settings.samples, temperature=temperature
    )
    manager.last_episodes = ([], [])  # (a batch whose env could not pose problems sets none)
    _, metrics = manager.sample_batch(
        lesson_id,
        n_examples=settings.n_examples or config.eval.n_examples,
        n_generations=settings.samples,
        mode="eval",
        seed=config.seed + EVAL_SEED_OFFSET,
        weight_step=step or 0,
        worker_id="eval",
        sampling=sampling,
    )
    env = manager.env(lesson_id)
    answer = getattr(getattr(env, "env", env), "answer", None)
    stops = set(response_stop_ids(manager.tokenizer, sampling.stop_tokens))
    problems, results = manager.last_episodes
    rows: list[list[dict[str, Any]]] = []
    for problem, episodes in zip(problems, results, strict=True):
        if any(e.failure is not None or not e.rollouts for e in episodes):
            continue
        if any(
            TERM_METRIC_PREFIX + t.name not in e.metrics
            for e in episodes
            for t in config.reward.terms
        ):
            continue  # a reward term could not grade it
        rows.append([])
        for k, episode in enumerate(episodes):
            first = episode.rollouts[0]
            text = response_text(episode.rollouts, manager.tokenizer, stops)
            reward = float(first.reward)
            metrics = {name: float(v) for name, v in episode.metrics.items()}
            row = {
                "lesson": lesson_id,
                "problem": problem.id,
                "sample": k,
                "prompt": manager.tokenizer.decode(first.prompt_tokens.tolist()),
                "response": text,
                "reward": reward,
                "correct": metrics["correct"] >= 0.5
                if "correct" in metrics
                else reward >= settings.pass_reward,
                "truncated": any(r.truncated for r in episode.rollouts),
                "metrics": metrics,
                "temperature": temperature,
            }
            if answer is not None:
                row["answer"] = answer(problem, text)
            rows[-1].append(row)
    posed = len(problems) + int(metrics.get("prompts_too_long", 0))
    dropped = posed - len(rows) if problems else int(metrics.get("env_errors", 0))
    return rows, answer is not None, dropped


def evaluate_policy(
    policy: Policy,
    registry: Registry,
    settings: EvalSettings,
    out_dir: Path | None,
    *,
    manager: Any = None,
) -> dict[str, Any]:
    """Sample and score every lesson of ``policy``'s config; write ``results.json`` and
    ``samples.jsonl`` into ``out_dir`` (``None``: nothing written). Returns the results:
    ``{"checkpoint", "step", "warnings", "samples", "temperature", "intervals", "lessons":
    {id: {"reward", "n", "problems", "dropped", <metrics>, "stats": {...}}}, "overall": {...}}``
    (``reward``: the mean over every sample; ``stats``: :func:`~marin_rl_core.eval_stats.summarize`'s
    estimates as ``{"value", "low", "high"}``). ``manager``: a
    :class:`~marin_rl_core.rollout.manager.RolloutManager` of the same config to sample with
    (given the policy's weights, and left open), instead of one built and shut down here."""
    from marin_rl_core.eval_stats import INTERVALS, summarize
    from marin_rl_core.rollout.manager import RolloutManager

    config = policy.config
    lessons = [lesson.id for lesson in config.curriculum.lessons]
    if out_dir is not None:  # refused before any sampling, not after it
        _writable(out_dir)
    own = manager is None
    if own:
        manager = RolloutManager(config, registry, model=policy.model, tokenizer=policy.tokenizer)
    else:
        manager.update_model(policy.model, weight_step=policy.step)
    everything: list[list[dict[str, Any]]] = []
    majority_everywhere = True
    results: dict[str, Any] = {}
    start = time.monotonic()
    try:
        what = "eval" if policy.step is None else f"eval step {policy.step}"
        for lesson_id in _progress(lessons, what):
            rows, majority, dropped = sample_rows(manager, lesson_id, settings, step=policy.step)
            everything.extend(rows)
            majority_everywhere &= majority
            flat = [s for problem in rows for s in problem]
            means = {
                name: sum(s["metrics"][name] for s in flat) / len(flat)
                for name in (flat[0]["metrics"] if flat else {})
            }
            results[lesson_id] = {
                "reward": sum(s["reward"] for s in flat) / len(flat) if flat else None,
                "n": len(flat),
                "problems": len(rows),
                "dropped": dropped,
                **means,
                "stats": _as_dicts(summarize(rows, settings.ks, majority=majority)),
            }
    finally:
        if own:
            manager.shutdown()
    temperatures = {s["temperature"] for p in everything for s in p}
    out = {
        "checkpoint": policy.source,
        "step": policy.step,
        "warnings": list(policy.warnings),
        "samples": settings.samples,
        "temperature": temperatures.pop() if len(temperatures) == 1 else None,
        "intervals": INTERVALS,
        "seconds": time.monotonic() - start,
        "lessons": results,
        "overall": _as_dicts(summarize(everything, settings.ks, majority=majority_everywhere)),
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        with (out_dir / "samples.jsonl").open("w") as f:
            for problem in everything:
                for row in problem:
                    f.write(json.dumps({"step": policy.step, **row}) + "\n")
        (out_dir / "results.json").write_text(json.dumps(out, indent=2) + "\n")
        out["out_dir"] = str(out_dir)
    return out


def _writable(out_dir: Path) -> None:
    from marin_rl_core.errors import ConfigError

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".marinrl-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"cannot write the eval's results to {out_dir} ({exc.strerror or exc}): give --out "
            "a directory you can write (free space, permissions)"
        ) from None


def _as_dicts(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: v.as_dict() if hasattr(v, "as_dict") else v for k, v in stats.items()}


def _progress(items: Sequence[str], what: str, unit: str = "lesson") -> Any:
    from tqdm.auto import tqdm

    return tqdm(items, desc=what, unit=unit, leave=False, disable=len(items) < 2)


def evaluate_checkpoint(
    path: str | Path,
    registry: Registry,
    *,
    n_examples: int | None = None,
    settings: EvalSettings | None = None,
    out_dir: Path | None = None,
    **config: Any,
) -> dict[str, Any]:
    """Score ``path`` (a run directory or one of its checkpoints) on every lesson of its run, or
    other lessons (``config``: as :func:`run_policy` takes it) (:func:`evaluate_policy`); results
    and samples go to ``out_dir``, by default ``<run>/evals/step-<N>``."""
    settings = settings or EvalSettings()
    if n_examples is not None:
        settings = attrs.evolve(settings, n_examples=n_examples)
    policy = run_policy(path, registry, **config)
    if out_dir is None and policy.run_dir is not None and policy.run_dir.exists():
        out_dir = policy.run_dir / "evals" / f"step-{policy.step:06d}"
    return evaluate_policy(policy, registry, settings, out_dir)


def evaluate_all_checkpoints(
    run_dir: str | Path, registry: Registry, settings: EvalSettings, **config: Any
) -> tuple[list[dict[str, Any]], list[str]]:
    """Every complete checkpoint of a run, oldest first (:func:`evaluate_policy`, one engine
    for all of them; each step's samples and results in ``<run>/evals/step-N/``). Returns the
    results and warnings (a damaged checkpoint is skipped, named). ``config``: as
    :func:`run_policy` takes it (other lessons or data)."""
    from marin_rl_core.learner.checkpoint import CheckpointError, checkpoints_newest_first
    from marin_rl_core.rollout.manager import RolloutManager

    run_dir = run_path(run_dir)
    checkpoints = checkpoints_newest_first(run_dir)[::-1]
    if not checkpoints:
        resolve_checkpoint(run_dir)  # raises: no checkpoint, saying what to do
    results: list[dict[str, Any]] = []
    warnings: list[str] = []
    manager = None
    try:
        for checkpoint in _progress([str(c) for c in checkpoints], "checkpoints", "checkpoint"):
            try:
                policy = run_policy(checkpoint, registry, **config)
            except CheckpointError as exc:
                warnings.append(f"{Path(checkpoint).name}: {exc}; skipped")
                logger.warning("eval --all: %s skipped", checkpoint, exc_info=True)
                continue
            if manager is None:
                manager = RolloutManager(
                    policy.config, registry, model=policy.model, tokenizer=policy.tokenizer
                )
            out_dir = run_dir / "evals" / f"step-{policy.step:06d}"
            results.append(evaluate_policy(policy, registry, settings, out_dir, manager=manager))
    finally:
        if manager is not None:
            manager.shutdown()
    return results, warnings


def plot_checkpoints(results: Sequence[dict[str, Any]], out: Path, title: str) -> Path:
    """pass@k (each k) and maj@k over all lessons against the checkpoint's step, their 95%
    intervals shaded, into the PNG ``out``."""
    from matplotlib.figure import Figure  # not pyplot: see report.plot_reward_curve

    steps = [r["step"] for r in results]
    names = list(dict.fromkeys(n for r in results for n in r["overall"] if "@" in n))
    fig = Figure(figsize=(9, 4.5), dpi=100)
    ax = fig.subplots()
    for name in names:
        points = [(s, r["overall"][name]) for s, r in zip(steps, results) if name in r["overall"]]
        xs = [s for s, _ in points]
        ax.plot(xs, [e["value"] for _, e in points], marker="o", markersize=3, label=name)
        ax.fill_between(
            xs, [e["low"] for _, e in points], [e["high"] for _, e in points], alpha=0.15
        )
    ax.set_xlabel("trainer step")
    ax.set_ylabel("all lessons (95% interval shaded)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    if names:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


__all__ = [
    "EvalSettings",
    "Policy",
    "evaluate_all_checkpoints",
    "evaluate_checkpoint",
    "evaluate_policy",
    "plot_checkpoints",
    "pretrained_policy",
    "run_policy",
    "sample_rows",
]
