"""The ``marinrl`` command.

Every command builds its own registry (``--plugin`` / ``--disable-plugin`` shape it), resolves
the config, and turns a :class:`~marin_rl_core.errors.MarinRLError` into a message on stderr and
its documented exit code (``docs/cli.md``). Nothing here imports JAX, levanter or Ray at module
level: ``marinrl --help`` and ``marinrl plugins list`` stay fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from marin_rl_core.cli.evaluate import eval_command, samples_command
from marin_rl_core.cli.options import (
    CONFIG_PANEL,
    ConfigOpt,
    CurriculumOpt,
    DisableOpt,
    EngineOpt,
    EnvOpt,
    LossOpt,
    ModelOpt,
    PluginOpt,
    SetOpt,
    StorageOpt,
    WeightTransferOpt,
    before_subcommand,
    err,
    guarded,
    model_override,
    registry_for,
    resolve,
)
from marin_rl_core.errors import ExitCode
from marin_rl_core.hookspecs import PROJECT, RECORD_TYPES

app = typer.Typer(
    name="marinrl",
    help="Reinforcement learning for language models, extended by plugins.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)
plugins_app = typer.Typer(help="Inspect the installed plugins.", no_args_is_help=True)
config_app = typer.Typer(help="Show and check run configs.", no_args_is_help=True)
app.add_typer(plugins_app, name="plugins")
app.add_typer(config_app, name="config")


@app.callback()
def main_callback(plugin: PluginOpt = None, disable_plugin: DisableOpt = None) -> None:
    """marinrl: RLOO/PPO post-training of language models on JAX, levanter and Ray.

    Every concrete piece (envs, losses, rollout storage, weight transfer, curricula) is a plugin;
    `marinrl plugins list` shows what is installed. Docs: docs/index.md.
    """
    before_subcommand["plugin"] = list(plugin or ())
    before_subcommand["disable_plugin"] = list(disable_plugin or ())


app.command("eval")(eval_command)  # marinrl eval and marinrl samples: cli/evaluate.py
app.command("samples")(samples_command)


@app.command()
def run(
    config: ConfigOpt = None,
    model: ModelOpt = None,
    env: EnvOpt = None,
    loss: LossOpt = None,
    storage: StorageOpt = None,
    weight_transfer: WeightTransferOpt = None,
    curriculum: CurriculumOpt = None,
    engine: EngineOpt = None,
    set_: SetOpt = None,
    ray_address: Annotated[
        str | None,
        typer.Option(help="Address of a running Ray cluster; default starts a local Ray."),
    ] = None,
    run_id: Annotated[str | None, typer.Option(help="Name of the run directory.")] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            help="Go on with the run in this directory (a path or a bucket URL, gs://...) from "
            "its newest checkpoint, with its saved config (--set may change it, for example "
            "trainer.num_train_steps).",
            rich_help_panel=CONFIG_PANEL,
        ),
    ] = None,
    plugin: PluginOpt = None,
    disable_plugin: DisableOpt = None,
) -> None:
    """Train: launch a trainer and rollout workers as a Ray job."""
    overrides = model_override(model)
    if ray_address is not None:
        overrides.append(f"ray_address={json.dumps(ray_address)}")
    if run_id is not None:
        overrides.append(f"run_id={json.dumps(run_id)}")

    def go() -> None:
        registry = registry_for(plugin, disable_plugin)
        files = config
        if resume is not None:
            files = [_resume_config(resume, config=config, run_id=run_id, model=model)]
            overrides.extend(_resume_overrides(resume))
        cfg = resolve(
            registry,
            config=files,
            set_=set_,
            selections={
                "env": env,
                "loss": loss,
                "storage": storage,
                "weight_transfer": weight_transfer,
                "curriculum": curriculum,
                "engine": engine,
            },
            extra_overrides=overrides,
        )
        _train(cfg, registry)

    guarded(go)


@plugins_app.command("list")
def plugins_list(
    kind: Annotated[
        str | None,
        typer.Option(help=f"Only this kind: {', '.join(RECORD_TYPES)}."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    plugin: PluginOpt = None,
    disable_plugin: DisableOpt = None,
) -> None:
    """List every registered plugin: name, kind, summary, distribution and version."""
    if kind is not None and kind not in RECORD_TYPES:
        import difflib

        close = difflib.get_close_matches(kind, list(RECORD_TYPES), n=1)
        raise typer.BadParameter(
            f"unknown kind {kind!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; choose from {', '.join(RECORD_TYPES)}",
            param_hint="--kind",
        )

    def go() -> None:
        registry = registry_for(plugin, disable_plugin)
        rows = []
        for entry in registry.entries(kind):
            hooks = sorted(
                impl_name
                for impl_name in dir(registry.manager.hook)
                if impl_name.startswith(PROJECT + "_")
                and any(
                    i.plugin_name == entry.plugin
                    for i in getattr(registry.manager.hook, impl_name).get_hookimpls()
                )
            )
            rows.append(
                {
                    "name": entry.name,
                    "kind": entry.kind,
                    "summary": entry.record.summary,
                    "distribution": entry.distribution,
                    "version": entry.version,
                    "plugin": entry.plugin,
                    "hooks": hooks,
                }
            )
        if as_json:
            typer.echo(json.dumps(rows, indent=2))
            return
        from rich.console import Console
        from rich.table import Table

        table = Table("name", "kind", "summary", "distribution", "version")
        for row in rows:
            table.add_row(
                row["name"], row["kind"], row["summary"], row["distribution"], row["version"]
            )
        Console().print(table)
        if registry.disabled:
            typer.echo(f"disabled: {', '.join(registry.disabled)}")

    guarded(go)


@config_app.command("show")
def config_show(
    config: ConfigOpt = None,
    model: ModelOpt = None,
    env: EnvOpt = None,
    loss: LossOpt = None,
    storage: StorageOpt = None,
    weight_transfer: WeightTransferOpt = None,
    curriculum: CurriculumOpt = None,
    engine: EngineOpt = None,
    set_: SetOpt = None,
    fmt: Annotated[str, typer.Option("--format", help="toml or yaml.")] = "toml",
    plugin: PluginOpt = None,
    disable_plugin: DisableOpt = None,
) -> None:
    """Print the fully resolved config, defaults included, as a --config file takes it."""

    def go() -> None:
        from marin_rl_core.config.converter import dump_config

        registry = registry_for(plugin, disable_plugin)
        cfg = resolve(
            registry,
            config=config,
            set_=set_,
            selections={
                "env": env,
                "loss": loss,
                "storage": storage,
                "weight_transfer": weight_transfer,
                "curriculum": curriculum,
                "engine": engine,
            },
            extra_overrides=model_override(model),
        )
        typer.echo(dump_config(cfg, registry, fmt=fmt), nl=False)

    guarded(go)


@config_app.command("validate")
def config_validate(
    file: Annotated[Path, typer.Argument(help="The config file to check.")],
    plugin: PluginOpt = None,
    disable_plugin: DisableOpt = None,
) -> None:
    """Check a config file: keys, types, plugin names, curriculum; exit 0 when valid."""

    def go() -> None:
        registry = registry_for(plugin, disable_plugin)
        resolve(registry, config=[file], set_=None, selections={})
        typer.echo(f"{file}: valid")

    guarded(go)


def _resume_config(
    run_dir: str, *, config: list[Path] | None, run_id: str | None, model: str | None
) -> Path:
    """``RUN_DIR/config.toml`` for ``--resume RUN_DIR``, after checking that it is a run."""
    from marin_rl_core.errors import ConfigError

    if config or run_id is not None or model is not None:
        raise ConfigError(
            "--resume takes the run's saved config: leave out --config, --run-id and --model "
            "(--set still changes single values)"
        )
    from marin_rl_core.learner.checkpoint import run_config_file

    return run_config_file(run_dir, what="--resume")


def _resume_overrides(run_dir: str) -> list[str]:
    """The run goes on in ``run_dir`` itself, wherever it was moved and whatever the cwd."""
    from marin_rl_core.rundir import absolute

    run_dir = absolute(run_dir)
    return [f"run_dir={json.dumps(str(run_dir.parent))}", f"run_id={json.dumps(run_dir.name)}"]


def _train(cfg: Any, registry: Any) -> None:
    from rich.console import Console

    from marin_rl_core.cli.report import plot_reward_curve, render_summary, summarize
    from marin_rl_core.job.driver import RLJob

    job = RLJob(cfg, registry)
    result = job.run(
        progress=bool(cfg.logging.progress),
        on_start=lambda: typer.echo(
            f"run {job.run_id}: writing to {job.run_dir}"
            + (f"\n{job.memory_estimate}" if job.memory_estimate else ""),
            err=True,
        ),
    )
    console = Console(stderr=True)
    console.print(render_summary(summarize(result.run_dir)))
    plot = plot_reward_curve(result.run_dir)
    typer.echo(f"reward curve: {plot}", err=True)
    if result.interrupted:
        err(
            f"interrupted at step {result.final_step}; a checkpoint was saved. Resume with:\n"
            f"  {job.resume_command()}"
        )
        raise typer.Exit(int(ExitCode.INTERRUPTED))


@app.command()
def export(
    run_dir: Annotated[str, typer.Argument(help="The run directory (a path or a bucket URL).")],
    out_dir: Annotated[Path, typer.Argument(help="Where to write the Hugging Face checkpoint.")],
    step: Annotated[
        int | None, typer.Option(help="Export this step's checkpoint (default: the newest).")
    ] = None,
    adapter: Annotated[
        bool,
        typer.Option(
            "--adapter",
            help="A LoRA run: write its adapters alone as a PEFT adapter folder, to load onto "
            "the base checkpoint with peft.PeftModel.from_pretrained.",
        ),
    ] = False,
    plugin: PluginOpt = None,
    disable_plugin: DisableOpt = None,
) -> None:
    """Write a run's trained policy as a Hugging Face checkpoint (safetensors, config, tokenizer
    and chat template) that transformers loads with from_pretrained; a LoRA run's with its
    adapters merged in, or (--adapter) the adapters alone as a PEFT folder."""

    def go() -> None:
        from marin_rl_core.learner.export import export_adapter, export_hf

        registry = registry_for(plugin, disable_plugin)
        if adapter:
            out, trained_step, base = export_adapter(run_dir, out_dir, registry, step=step)
            typer.echo(
                f"exported the LoRA adapters of step {trained_step} of {run_dir} to {out}\n"
                f"  load them: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("
                f"{base!r}), {str(out)!r})"
            )
            return
        out, trained_step = export_hf(run_dir, out_dir, registry, step=step)
        typer.echo(
            f"exported step {trained_step} of {run_dir} to {out}\n"
            f"  load it: AutoModelForCausalLM.from_pretrained({str(out)!r})"
        )

    guarded(go)


@app.command()
def report(
    run_dir: Annotated[str, typer.Argument(help="The run directory (a path or a bucket URL).")],
) -> None:
    """Print a run's summary table and redraw its reward curve (RUN_DIR/reward_curve.png)."""

    def go() -> None:
        from rich.console import Console

        from marin_rl_core.cli.report import plot_reward_curve, render_summary, summarize
        from marin_rl_core.errors import ConfigError

        try:
            summary = summarize(run_dir)
        except FileNotFoundError as exc:
            raise ConfigError(str(exc)) from None
        if not summary["rows"]:
            raise ConfigError(
                f"{run_dir}/metrics.jsonl has no readable rows: the run has logged nothing "
                "yet, or the file is damaged"
            )
        Console().print(render_summary(summary))
        typer.echo(f"reward curve: {plot_reward_curve(run_dir)}")

    guarded(go)


def main() -> None:
    """Console-script entry point. An error no command turned into a message (a bug, or a
    failure nobody foresaw) is one line on the console; its traceback goes to a log file."""
    from marin_rl_core import deferred_imports
    from marin_rl_core.cli import stray_errors

    deferred_imports.defer()  # before eval and export import levanter
    stray_errors.install()  # late "Event loop is closed" reports go to the log
    try:
        app()
    except KeyboardInterrupt:
        err("interrupted")
        sys.exit(int(ExitCode.INTERRUPTED))
    except Exception as exc:  # noqa: BLE001 - the last line of defence
        import tempfile
        import time
        import traceback

        log = Path(tempfile.gettempdir()) / f"marinrl-error-{time.strftime('%Y%m%d-%H%M%S')}.log"
        try:
            log.write_text("".join(traceback.format_exception(exc)))
            where = f"The traceback is in {log}"
        except OSError:
            where = "The traceback could not be written"
        first = (str(exc).strip().splitlines() or [""])[0]
        err(
            f"unexpected {type(exc).__name__}: {first}. {where}; this is a marinrl bug: please "
            "report it with that file."
        )
        sys.exit(int(ExitCode.FAILURE))
