"""What every ``marinrl`` command shares: its options (plugin flags, selections, ``--config``,
``--set`` checked as ``KEY=VALUE``, ``--model``), the registry a command builds from its flags,
config resolution with its notes on stderr, and the one way a user-caused error becomes a
message and its exit code (:func:`guarded`). Imports nothing heavy: ``marinrl --help`` stays
fast."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from marin_rl_core.errors import MarinRLError

PLUGINS_PANEL = "Plugins"
SELECT_PANEL = "Plugin selection"
CONFIG_PANEL = "Configuration"

PluginOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--plugin",
        help="Load an extra plugin module (import path). Repeatable.",
        rich_help_panel=PLUGINS_PANEL,
    ),
]
DisableOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--disable-plugin",
        help="Skip an installed plugin by its entry-point name. Repeatable.",
        rich_help_panel=PLUGINS_PANEL,
    ),
]
ConfigOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--config",
        "-c",
        help="A run config (.toml or .yaml). Repeatable; later files win.",
        rich_help_panel=CONFIG_PANEL,
    ),
]


def check_set(values: list[str] | None) -> list[str] | None:
    """``--set`` takes ``KEY=VALUE`` as one argument: ``--set trainer.num_train_steps 5`` would
    otherwise end in click's "unexpected extra argument (5)"."""
    for value in values or ():
        if "=" not in value:
            raise typer.BadParameter(
                f"--set takes KEY=VALUE as one argument, got {value!r}: write "
                f"--set {value}=VALUE (no spaces around '=')"
            )
    return values


SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="Override one value: --set loss.kl_coef=0.05 (TOML value syntax). Repeatable.",
        rich_help_panel=CONFIG_PANEL,
        callback=check_set,
    ),
]


def select(kind: str) -> Any:
    return typer.Option(
        f"--{kind.replace('_', '-')}",
        help=f"The {kind.replace('_', ' ')} plugin to use (see `marinrl plugins list --kind {kind}`).",
        rich_help_panel=SELECT_PANEL,
    )


ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="A Hugging Face checkpoint to train: a local directory or a hub id "
        "(Qwen/Qwen3-0.6B). Shorthand for --set model.checkpoint=...",
        rich_help_panel=CONFIG_PANEL,
    ),
]
EnvOpt = Annotated[str | None, select("env")]
LossOpt = Annotated[str | None, select("loss")]
StorageOpt = Annotated[str | None, select("storage")]
WeightTransferOpt = Annotated[str | None, select("weight_transfer")]
CurriculumOpt = Annotated[str | None, select("curriculum")]
EngineOpt = Annotated[str | None, select("engine")]

T = TypeVar("T")


def err(message: str) -> None:
    typer.echo(f"error: {message}", err=True)


def guarded(fn: Callable[[], T]) -> T:
    """Run ``fn``; a user-caused error becomes a message and its exit code."""
    try:
        return fn()
    except MarinRLError as exc:
        err(str(exc))
        raise typer.Exit(int(exc.exit_code)) from None


def registry_for(plugin: list[str] | None, disable: list[str] | None):  # type: ignore[no-untyped-def]
    """The registry for a command: its own ``--plugin``/``--disable-plugin`` flags plus those
    given before the subcommand (``marinrl --plugin m run ...``)."""
    from marin_rl_core.registry import build_registry

    extra = [*before_subcommand["plugin"], *(plugin or ())]
    blocked = [*before_subcommand["disable_plugin"], *(disable or ())]
    return build_registry(extra=dict.fromkeys(extra), blocked=dict.fromkeys(blocked))


# The --plugin / --disable-plugin flags given before the subcommand; set by the root callback at
# every invocation.
before_subcommand: dict[str, list[str]] = {"plugin": [], "disable_plugin": []}


def resolve(
    registry: Any,
    *,
    config: list[Path] | None,
    set_: list[str] | None,
    selections: dict[str, str | None],
    extra_overrides: list[str] = (),  # type: ignore[assignment]
):  # type: ignore[no-untyped-def]
    from marin_rl_core.config.loading import resolve_config

    notes: list[str] = []
    resolved = resolve_config(
        registry,
        files=config or (),
        selections=selections,
        overrides=[*(set_ or ()), *extra_overrides],
        notes=notes,
    )
    for note in notes:
        typer.echo(note, err=True)
    return resolved


def model_override(model: str | None) -> list[str]:
    return [] if model is None else [f"model.checkpoint={json.dumps(model)}"]
