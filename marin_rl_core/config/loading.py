"""Resolving a run's config: class defaults < ``--config FILE`` < selection flags (``--env math``)
< ``--set path=value``, then validation and the settings derived from the rest
(a checkpoint's ``model.max_seq_len``)."""

from __future__ import annotations

import json
import logging
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from cattrs.errors import ClassValidationError, IterableValidationError

from marin_rl_core.config.checkpoint_defaults import checkpoint_defaults
from marin_rl_core.config.colocation import local_accelerators, resolve_colocation
from marin_rl_core.config.converter import drop_none, format_structure_error, make_converter
from marin_rl_core.config.schema import CHOICE_TYPES, RLJobConfig
from marin_rl_core.config.validation import validate_config
from marin_rl_core.errors import ConfigError
from marin_rl_core.hookspecs import RECORD_TYPES
from marin_rl_core.registry import Registry
from marin_rl_core.types import LessonConfig

logger = logging.getLogger(__name__)

# --- loading -------------------------------------------------------------------------------------


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a ``.toml``, ``.yaml`` or ``.yml`` file (a path or an fsspec URL) into plain data."""
    from marin_rl_core.rundir import run_path

    path = run_path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist.")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
            f"offset {exc.start}); save it as UTF-8."
        ) from None
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror}.") from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(
                f"config file {str(path)!r}: unknown format {path.suffix!r}; use .toml or .yaml."
            )
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid: {exc}") from exc
    except Exception as exc:  # yaml.YAMLError without importing yaml at module level
        raise ConfigError(f"config file {str(path)!r} is not valid: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a table at the top level.")
    return data


_PATH_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:\[(\d+)\])?")


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """Parse ``--set a.b[0].c=VALUE``. VALUE is read as a TOML value (``0.05``, ``true``,
    ``"x"``, ``[1, 2]``); anything that is not valid TOML is taken as a plain string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected PATH=VALUE, e.g. --set loss.kl_coef=0.05")
    path_text, value_text = text.split("=", 1)
    path: list[str | int] = []
    for part in path_text.strip().split("."):
        match = _PATH_PART.fullmatch(part)
        if not match:
            raise ConfigError(f"--set {text!r}: {part!r} is not a valid key in the path")
        path.append(match.group(1))
        if match.group(2) is not None:
            path.append(int(match.group(2)))
    try:
        value = tomllib.loads(f"v = {value_text}")["v"]
    except tomllib.TOMLDecodeError:
        value = value_text
    return path, value


def _apply_override(data: dict[str, Any], path: Sequence[str | int], value: Any, text: str) -> None:
    node: Any = data
    for i, key in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(key, int):
            _check_index(node, key, path[:i], text)
            node = node[key]
            continue
        if key not in node or node[key] is None:
            node[key] = [] if isinstance(nxt, int) else {}
        node = node[key]
    last = path[-1]
    if isinstance(last, int):
        _check_index(node, last, path[:-1], text)
    node[last] = value


def _check_index(node: Any, index: int, where: Sequence[str | int], text: str) -> None:
    if isinstance(node, list) and index < len(node):
        return
    name = ".".join(str(p) for p in where)
    if not isinstance(node, list):
        raise ConfigError(f"--set {text!r}: {name} is not a list, so [{index}] cannot index it")
    ids = [x.get("id") for x in node if isinstance(x, dict) and x.get("id")]
    has = f"{len(node)} item{'s' if len(node) != 1 else ''}"
    if ids:
        has += " (" + ", ".join(f"[{i}] {x}" for i, x in enumerate(ids)) + ")"
    raise ConfigError(f"--set {text!r}: index {index} is out of range: {name} has {has}")


def _check_plugin_names(data: Mapping[str, Any], registry: Registry) -> None:
    for kind in RECORD_TYPES:
        section = data.get(kind)
        if isinstance(section, Mapping) and "name" in section:
            if isinstance(section["name"], str):
                registry.get(kind, section["name"], where=f"$.{kind}.name")
    lessons = (
        data.get("curriculum", {}).get("lessons", [])
        if isinstance(data.get("curriculum"), Mapping)
        else []
    )
    for i, lesson in enumerate(lessons if isinstance(lessons, list) else []):
        if isinstance(lesson, Mapping) and lesson.get("env"):
            registry.get("env", lesson["env"], where=f"$.curriculum.lessons[{i}].env")


def resolve_config(
    registry: Registry,
    *,
    files: Iterable[str | Path] = (),
    data: Mapping[str, Any] | None = None,
    selections: Mapping[str, str | None] | None = None,
    overrides: Iterable[str] = (),
    notes: list[str] | None = None,
) -> RLJobConfig:
    """Resolve a run's config: defaults < files < ``data`` < selections < ``--set`` overrides.

    A run on a Hugging Face checkpoint that sets no ``model.max_seq_len`` (or sets ``"auto"``)
    gets one derived from its lessons' prompts and ``max_tokens``
    (:func:`~marin_rl_core.config.sequence_length.derive_max_seq_len`); the resolved config holds the
    number, so a saved ``config.toml`` keeps it.

    Args:
        registry: the loaded plugins (plugin sections structure into their config classes).
        files: config files, later ones overriding earlier ones key by key.
        data: plain data merged after the files (used by tests and the Python API).
        selections: ``{kind: name}`` from flags like ``--env math``; ``None`` values are skipped.
        overrides: ``PATH=VALUE`` strings from ``--set``.
        notes: when given, sentences about settings derived rather than given are appended
            (the CLI prints them).

    Raises:
        ConfigError: naming the path of every bad key or value.
        UnknownPluginError: for a plugin name nothing registers.
    """
    merged: dict[str, Any] = {}
    for f in files:
        _deep_merge(merged, read_config_file(f))
    if data:
        _deep_merge(merged, json.loads(json.dumps(data)))
    for kind, name in (selections or {}).items():
        if name is not None:
            section = merged.setdefault(kind, {})
            if not isinstance(section, dict):
                raise ConfigError(f"$.{kind}: expected a table, got {type(section).__name__}")
            _switch_plugin(section, kind, name, registry, notes)
    parsed = [(text, *parse_override(text)) for text in overrides]
    converter = make_converter(registry)
    # `--set curriculum.lessons[I]...` with no lessons in the config: the lessons the job would
    # run are the env plugin's defaults, so index those (the other overrides decide the env).
    if any(_indexes_lessons(path) for _, path, _ in parsed) and not _lessons_of(merged):
        others = json.loads(json.dumps(merged))
        for text, path, value in parsed:
            if not _indexes_lessons(path):
                _apply_override(others, path, value, text)
        defaults = _structure(others, registry, converter).curriculum.lessons
        curriculum = merged.setdefault("curriculum", {})
        if not isinstance(curriculum, dict):
            raise ConfigError(f"$.curriculum: expected a table, got {type(curriculum).__name__}")
        curriculum["lessons"] = [drop_none(converter.unstructure(x)) for x in defaults]
    for text, path, value in parsed:
        _apply_override(merged, path, value, text)
    _migrate_inference_engine(merged, notes)
    model_section = merged.get("model")
    derive_seq_len = not isinstance(model_section, dict) or "max_seq_len" not in model_section
    if isinstance(model_section, dict) and model_section.get("max_seq_len") == "auto":
        del model_section["max_seq_len"]
        derive_seq_len = True
    config = _structure(merged, registry, converter)
    accelerators = local_accelerators()
    config = resolve_colocation(config, merged, notes, accelerators)
    config = checkpoint_defaults(config, merged, notes, accelerators)
    validate_config(config, registry, converter)
    if notes is not None:
        given = {path[1]: value for _, path, value in parsed
                 if len(path) == 2 and path[0] == "sampling"}  # fmt: skip
        notes.extend(_shadowed_sampling(config, given))
    if derive_seq_len and config.model.checkpoint:
        from marin_rl_core.config.sequence_length import derive_max_seq_len

        value, note = derive_max_seq_len(config, registry)
        config = attrs.evolve(config, model=attrs.evolve(config.model, max_seq_len=value))
        logger.info("%s", note)
        if notes is not None:
            notes.append(note)
    return config


def _shadowed_sampling(config: RLJobConfig, given: dict[str, Any]) -> list[str]:
    """A note for each lesson with sampling of its own (an env's default lessons often have
    one) that hides a ``--set sampling.KEY`` value the user gave (``given``: key to value):
    ``--set sampling.n_prompts=4`` with ``--env guess`` still samples the lesson's 32 prompts
    a batch. (Not for values from files: a saved run's config lists every setting.)"""
    said = []
    for i, lesson in enumerate(config.curriculum.lessons):
        if lesson.sampling is None:
            continue
        hidden = [
            f"{key} {getattr(lesson.sampling, key)!r} (not {value!r})"
            for key, value in given.items()
            if hasattr(lesson.sampling, key) and _plain(getattr(lesson.sampling, key)) != value
        ]
        if hidden:
            said.append(
                f"lesson {lesson.id!r} samples with its own settings, not $.sampling's: "
                f"{', '.join(hidden)}; set curriculum.lessons[{i}].sampling.KEY to change them"
            )
    return said


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _migrate_inference_engine(merged: dict[str, Any], notes: list[str] | None) -> None:
    """``model.inference_engine`` (before engines were plugins; a saved run's ``config.toml``
    may hold it) is read as ``[engine] name``, unless that is set too."""
    model = merged.get("model")
    if not isinstance(model, dict) or "inference_engine" not in model:
        return
    old = model.pop("inference_engine")
    engine = merged.setdefault("engine", {})
    if isinstance(engine, dict) and "name" not in engine and isinstance(old, str):
        engine["name"] = old
    note = (
        f"model.inference_engine = {old!r} is read as [engine] name = {engine.get('name')!r}: "
        "generation engines are plugins now (--engine NAME; docs/configuration.md)"
    )
    logger.warning("%s", note)
    if notes is not None:
        notes.append(note)


def _indexes_lessons(path: Sequence[str | int]) -> bool:
    return list(path[:2]) == ["curriculum", "lessons"] and len(path) > 2


def _lessons_of(data: Mapping[str, Any]) -> Any:
    curriculum = data.get("curriculum")
    return curriculum.get("lessons") if isinstance(curriculum, Mapping) else None


def _switch_plugin(
    section: dict[str, Any], kind: str, name: str, registry: Registry, notes: list[str] | None
) -> None:
    """Select plugin ``name`` in a ``[kind]`` table (``--loss ppo``). A table written for
    another plugin (a resumed run's ``[loss]`` of ``grpo``) keeps the settings the new plugin
    also has (``kl_coef``) and drops the others, saying which: they mean nothing to it."""
    before = section.get("name")
    section["name"] = name
    if before in (None, name) or kind not in RECORD_TYPES:
        return
    try:
        fields = {f.name for f in attrs.fields(registry.get(kind, name).config_class)}
    except Exception:  # noqa: BLE001 - an unknown name is reported where it is structured
        return
    dropped = sorted(k for k in section if k != "name" and k not in fields)
    for key in dropped:
        del section[key]
    if dropped and notes is not None:
        notes.append(
            f"--{kind} {name} replaces {before}: its settings {', '.join(dropped)} do not apply "
            f"to {name} and are dropped"
        )


def _structure(merged: dict[str, Any], registry: Registry, converter: Any) -> RLJobConfig:
    """The config that ``merged`` (files, selections and overrides, as plain data) describes:
    structured over the class defaults, plugin defaults filled in (the env's default lessons
    among them); not validated yet."""
    _check_plugin_names(merged, registry)
    # Partial tables override the defaults key by key: `--set eval.sampling.max_tokens=5` keeps
    # eval's greedy temperature rather than rebuilding SamplingParams from its class defaults.
    # (Plugin sections unstructure to just their name here, so a plugin's keys always start
    # from the defaults of the plugin the section selects.)
    merged = _merged(drop_none(converter.unstructure(RLJobConfig())), merged)
    # So do a lesson's own tables, over the run's: `sampling = {max_tokens = 8}` keeps the run's
    # temperature, `eval_sampling = {max_tokens = 8}` stays greedy.
    run_tables = {"sampling": merged.get("sampling"), "eval_sampling": merged["eval"]["sampling"]}
    for lesson in _lessons_of(merged) or []:
        for key, run in run_tables.items():
            if isinstance(lesson, dict) and isinstance(lesson.get(key), dict):
                if isinstance(run, dict):
                    lesson[key] = _merged(run, lesson[key])
    try:
        config = converter.structure(merged, RLJobConfig)
    except (ClassValidationError, IterableValidationError) as exc:
        raise ConfigError("invalid config:\n" + format_structure_error(exc, merged)) from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid config: {exc}") from exc
    return _fill_plugin_defaults(config, registry, converter)


def _merged(base: Mapping[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(base))
    _deep_merge(out, other)
    return out


def _deep_merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def _fill_plugin_defaults(config: RLJobConfig, registry: Registry, converter) -> RLJobConfig:  # type: ignore[no-untyped-def]
    changes: dict[str, Any] = {}
    for kind in CHOICE_TYPES:
        choice = getattr(config, kind)
        if choice.config is None:
            record = registry.get(kind, choice.name)
            choice = attrs.evolve(choice, config=record.config_class())
            changes[kind] = choice
    config = attrs.evolve(config, **changes)
    if not config.curriculum.lessons:
        env_record = registry.get("env", config.env.name)
        if env_record.default_lessons is not None:  # type: ignore[attr-defined]
            lessons = tuple(env_record.default_lessons(config.env.config))  # type: ignore[attr-defined]
        else:
            lessons = (LessonConfig(id=config.env.name),)
        lessons = tuple(
            attrs.evolve(lesson, env=lesson.env or config.env.name) for lesson in lessons
        )
        config = attrs.evolve(config, curriculum=attrs.evolve(config.curriculum, lessons=lessons))
    return config


__all__ = [
    "parse_override",
    "read_config_file",
    "resolve_config",
]
