"""``marinrl eval`` (a run's checkpoint, or any Hugging Face checkpoint on any env: pass@k, maj@k
and mean reward with intervals, every sample kept) and ``marinrl samples`` (what a policy
wrote, best and worst first), registered on the ``marinrl`` command by
:mod:`marin_rl_core.cli.app`."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from marin_rl_core.cli.options import (
    ConfigOpt,
    DisableOpt,
    EnvOpt,
    PluginOpt,
    SetOpt,
    guarded,
    model_override,
    registry_for,
    resolve,
)


@contextlib.contextmanager
def _log_to_run(path: str, name: str) -> Iterator[None]:
    """Log records (tracebacks of a damaged checkpoint skipped, levanter's own) go to
    ``RUN_DIR/logs/NAME`` while the block runs, not to the console, which shows only the
    command's own warnings. ``path`` is a run directory or one of its checkpoints (a run on a
    bucket logs to its local copy)."""
    import logging

    from marin_rl_core.job.actors import attach_log_file
    from marin_rl_core.rundir import local_copy, run_path

    where = run_path(path)
    run_dir = where if (where / "config.toml").is_file() else where.parent.parent
    root = logging.getLogger()
    level = root.level
    try:
        logs = local_copy(run_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        handler = attach_log_file(logs / name)
    except OSError:  # a read-only run: nowhere to keep them, and not on the console either
        handler = logging.NullHandler()
        root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        handler.close()


def eval_command(
    checkpoint: Annotated[
        str | None,
        typer.Argument(
            help="A run directory (its latest checkpoint) or a checkpoint directory; a path or "
            "a bucket URL. Leave out with --model."
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="A Hugging Face checkpoint (a directory or a hub id) to evaluate instead of a "
            "run, on --env and --set as `marinrl run` takes them (a run: they change its saved "
            "config, to evaluate it on other lessons)."
        ),
    ] = None,
    env: EnvOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    samples: Annotated[int, typer.Option(min=1, help="Samples per problem.")] = 1,
    k: Annotated[
        list[int] | None,
        typer.Option(
            "--k",
            min=1,
            help="pass@k and maj@k for this k (repeat: --k 1 --k 4); default 1 and "
            "the number of samples.",
        ),
    ] = None,
    temperature: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="Sampling temperature (default: the lesson's eval temperature, greedy, for one "
            "sample; 1.0 for several).",
        ),
    ] = None,
    n_examples: Annotated[
        int | None,
        typer.Option(help="Held-out problems per lesson (default: the run's eval.n_examples)."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Where results.json and samples.jsonl go (default: RUN/evals/step-N for a run, "
            "evals/<model name> for --model)."
        ),
    ] = None,
    every: Annotated[
        bool,
        typer.Option(
            "--all",
            help="Every checkpoint of the run: a table and a plot (RUN/evals/checkpoints.png) of "
            "pass@k against step.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    plugin: PluginOpt = None,
    disable_plugin: DisableOpt = None,
) -> None:
    """Score a policy on held-out problems: a run's checkpoint on its run's lessons, or a Hugging
    Face checkpoint (--model) on any env. Prints mean reward, pass@k and maj@k with 95%
    intervals per lesson; every sample goes to samples.jsonl beside results.json."""

    def go() -> None:
        from marin_rl_core.errors import ConfigError
        from marin_rl_core.job.evaluation import EvalSettings

        if (checkpoint is None) == (model is None):
            raise ConfigError(
                "give a run (or one of its checkpoints) or --model HF_CHECKPOINT"
                + (", not both" if model is not None else "")
                + ": `marinrl eval runs/rl-1` or `marinrl eval --model DIR --env math`"
            )
        ks = tuple(k) if k else tuple(dict.fromkeys((1, samples)))
        settings = EvalSettings(
            samples=samples, ks=ks, temperature=temperature, n_examples=n_examples
        )
        registry = registry_for(plugin, disable_plugin)
        if every:
            if model is not None or out is not None:
                raise ConfigError("--all evaluates a run's checkpoints into RUN/evals/: give a run")
            _eval_every(checkpoint, registry, settings)  # type: ignore[arg-type]
            return
        if model is not None:
            results = _eval_model(model, registry, settings)
        else:
            results = _eval_run(checkpoint, registry, settings)  # type: ignore[arg-type]
        for warning in results["warnings"]:
            typer.echo(f"warning: {warning}", err=True)
        if as_json:
            typer.echo(json.dumps(results, indent=2))
            return
        from rich.console import Console

        Console().print(results_table(results))
        typer.echo(results["intervals"])
        if "out_dir" in results:
            typer.echo(f"samples and results: {results['out_dir']}")

    def _eval_model(spec: str, registry: Any, settings: Any) -> dict[str, Any]:
        from marin_rl_core.job.evaluation import evaluate_policy, pretrained_policy

        cfg = resolve(
            registry,
            config=config,
            set_=set_,
            selections={"env": env},
            extra_overrides=model_override(spec),
        )
        where = out or Path("evals") / Path(spec.rstrip("/")).name
        return evaluate_policy(pretrained_policy(cfg), registry, settings, where)

    def _eval_every(path: str, registry: Any, settings: Any) -> None:
        from rich.console import Console

        from marin_rl_core.job.evaluation import evaluate_all_checkpoints, plot_checkpoints
        from marin_rl_core.rundir import is_remote, local_copy, put, run_path

        _check_run(path)
        with _log_to_run(path, "eval.log"):
            results, warnings = evaluate_all_checkpoints(path, registry, settings, **_other())
        for warning in warnings:
            typer.echo(f"warning: {warning}", err=True)
        run_dir = run_path(path)
        plot = local_copy(run_dir) / "evals" / "checkpoints.png"
        plot_checkpoints(results, plot, f"{run_dir.name}: eval of each checkpoint")
        where = put(plot, run_dir, "evals/checkpoints.png") if is_remote(run_dir) else plot
        if as_json:
            summary = {"checkpoints": results, "warnings": warnings, "plot": str(where)}
            typer.echo(json.dumps(summary, indent=2))
            return
        Console().print(checkpoints_table(results))
        if results:
            typer.echo(results[0]["intervals"])
        typer.echo(f"plot: {where}\nsamples and results: {run_dir / 'evals'}/step-N/")

    def _other() -> dict[str, Any]:
        """What --config, --env and --set change of a run's config (other lessons or data)."""
        return {"files": config or (), "selections": {"env": env}, "overrides": set_ or ()}

    def _check_run(path: str) -> None:
        from marin_rl_core.learner.checkpoint import run_config_file
        from marin_rl_core.rundir import run_path

        where = run_path(path)
        if not any((d / "config.toml").is_file() for d in (where, where.parent.parent)):
            # Neither a run nor one of its checkpoints: say so before loading anything (and
            # before a log file is written anywhere).
            run_config_file(where)

    def _eval_run(path: str, registry: Any, settings: Any) -> dict[str, Any]:
        from marin_rl_core.errors import ConfigError
        from marin_rl_core.job.evaluation import evaluate_checkpoint

        _check_run(path)
        try:
            with _log_to_run(path, "eval.log"):
                return evaluate_checkpoint(
                    path, registry, settings=settings, out_dir=out, **_other()
                )
        except FileNotFoundError as exc:
            raise ConfigError(str(exc)) from None

    guarded(go)


def results_table(results: dict[str, Any]) -> Any:
    """The table ``marinrl eval`` prints: per lesson (and over all of them), a row per
    statistic with its value and 95% interval, then the env's own metrics' means."""
    from rich.table import Table

    temperature = results.get("temperature")
    title = f"eval of {results['checkpoint']}: {results['samples']} sample(s) a problem" + (
        f" at temperature {temperature:g}" if temperature is not None else ""
    )
    table = Table("lesson", "problems", "statistic", "value", "95% interval", title=title)
    skip = ("reward", "n", "problems", "dropped", "stats")
    rows = list(results["lessons"].items())
    if len(rows) > 1:
        rows.append(("all", {"problems": results["overall"].get("problems", 0), "dropped": 0,
                             "stats": results["overall"]}))  # fmt: skip
    for lesson, row in rows:
        problems = str(row["problems"]) + (f" ({row['dropped']} dropped)" if row["dropped"] else "")
        if not row["problems"]:
            table.add_row(lesson, problems, "no problem scored", "", "", end_section=True)
            continue
        stats = [(k, v) for k, v in row["stats"].items() if isinstance(v, dict)]
        means = [(k, v) for k, v in row.items() if k not in skip]
        for i, (name, estimate) in enumerate(stats):
            table.add_row(
                lesson if i == 0 else "",
                problems if i == 0 else "",
                name,
                f"{estimate['value']:.3f}",
                f"[{estimate['low']:.3f}, {estimate['high']:.3f}]",
                end_section=i == len(stats) - 1 and not means,
            )
        for j, (name, value) in enumerate(means):
            table.add_row("", "", name, f"{value:.3f}", "", end_section=j == len(means) - 1)
    return table


def checkpoints_table(results: list[dict[str, Any]]) -> Any:
    """``marinrl eval --all``'s table: a row per checkpoint, each statistic over all lessons as
    ``value [low, high]``."""
    from rich.table import Table

    names = list(
        dict.fromkeys(n for r in results for n, v in r["overall"].items() if isinstance(v, dict))
    )
    table = Table("step", "problems", *names, title="eval of each checkpoint, all lessons")
    for r in results:
        cells = [
            f"{e['value']:.3f} [{e['low']:.2f}, {e['high']:.2f}]"
            if (e := r["overall"].get(n))
            else ""
            for n in names
        ]
        table.add_row(str(r["step"]), str(r["overall"].get("problems", 0)), *cells)
    return table


def read_samples(path: str, *, evals: bool, step: int | None) -> tuple[list[dict[str, Any]], str]:
    """The sample rows ``marinrl samples`` shows and where they came from: a ``samples.jsonl``
    file; a ``marinrl eval`` output directory; a run's training samples (``samples.jsonl``), or
    with ``evals`` those of its evals (``eval_samples.jsonl``). Rows of ``step`` (``None``: the
    last step there is)."""
    from marin_rl_core.errors import ConfigError
    from marin_rl_core.metrics import EVAL_SAMPLES_FILE
    from marin_rl_core.rundir import run_path

    where = run_path(path)
    if where.is_file():
        file = where
    elif evals:
        file = where / EVAL_SAMPLES_FILE
        if not file.is_file():
            raise ConfigError(
                f"{path} has no {EVAL_SAMPLES_FILE}: a run keeps logging.samples_per_step "
                "held-out samples of each lesson at each eval (`marinrl eval RUN` writes its own "
                "to RUN/evals/step-N/, which `marinrl samples RUN/evals/step-N` shows)"
            )
    else:
        file = where / "samples.jsonl"
        if not file.is_file():
            raise ConfigError(
                f"{path} has no samples.jsonl: give a run directory (its training samples, "
                "logging.samples_per_step a step), an eval's output directory or a samples.jsonl"
            )
    rows = []
    lines = file.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):  # (a last line still being written is left out)
                raise ConfigError(
                    f"{file} line {number} is not JSON: the file is damaged"
                ) from None
    steps = sorted({r.get("step") for r in rows if r.get("step") is not None})
    if step is None and steps:
        step = steps[-1]
    if step is not None:
        if step not in steps:
            has = f"it has steps {steps[0]}..{steps[-1]}" if steps else "its samples have no step"
            raise ConfigError(f"{file} has no samples of step {step}; {has}")
        rows = [r for r in rows if r.get("step") == step]
    return rows, str(file)


def samples_command(
    path: Annotated[
        str,
        typer.Argument(
            help="A run directory (its training samples; --eval: its evals' samples), a "
            "`marinrl eval` output directory, or a samples.jsonl file."
        ),
    ],
    step: Annotated[int | None, typer.Option(help="The step (default: the last one).")] = None,
    evals: Annotated[
        bool, typer.Option("--eval", help="A run's held-out samples of its evals, not training.")
    ] = False,
    lesson: Annotated[str | None, typer.Option(help="Only this lesson's samples.")] = None,
    n: Annotated[int, typer.Option(min=1, help="Samples shown from each end.")] = 3,
    width: Annotated[int, typer.Option(min=20, help="Characters of a prompt shown.")] = 200,
) -> None:
    """Show what a policy wrote: a step's samples with their rewards, the best then the
    worst."""

    def go() -> None:
        from rich.console import Console
        from rich.panel import Panel

        from marin_rl_core.errors import ConfigError

        rows, source = read_samples(path, evals=evals, step=step)
        if lesson is not None:
            lessons = sorted({str(r.get("lesson")) for r in rows})
            rows = [r for r in rows if r.get("lesson") == lesson]
            if not rows:
                raise ConfigError(f"no samples of lesson {lesson!r} there; it has {lessons}")
        if not rows:
            raise ConfigError(f"{source} has no samples")
        ranked = sorted(rows, key=lambda r: -float(r.get("reward", 0.0)))
        shown = ranked if len(ranked) <= 2 * n else [*ranked[:n], *ranked[-n:]]
        console = Console()
        rewards = [float(r.get("reward", 0.0)) for r in rows]
        console.print(
            f"{source}: step {rows[0].get('step')}, {len(rows)} samples, reward mean "
            f"{sum(rewards) / len(rewards):.3f} (min {min(rewards):.3f}, max {max(rewards):.3f}); "
            + ("all of them" if shown is ranked else f"the best {n} and the worst {n}"),
            soft_wrap=True,
        )
        for i, row in enumerate(shown):
            if shown is not ranked and i == n:
                console.rule("worst")
            terms = row.get("reward_terms") or {}
            detail = ", ".join(f"{k} {v:.3f}" for k, v in terms.items())
            if "correct" in row:
                detail = ", ".join(
                    filter(None, [f"correct {bool(row['correct'])}".lower(), detail])
                )
            title = (
                f"reward {float(row.get('reward', 0.0)):.3f}"
                + (f" ({detail})" if detail else "")
                + f"  {row.get('lesson')} / {row.get('problem')}"
            )
            prompt = str(row.get("prompt", ""))
            prompt = prompt if len(prompt) <= width else "..." + prompt[-width:]
            body = f"[dim]{_escape(prompt)}[/dim]\n{_escape(str(row.get('response', '')))}"
            console.print(Panel(body, title=title, title_align="left"))

    guarded(go)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
