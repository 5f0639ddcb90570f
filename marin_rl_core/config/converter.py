"""The one cattrs converter of run configs, built after the plugins load (:func:`make_converter`):
unknown keys are errors and every error names its path (``$.loss.kl_coef``); printing configs
back out (:func:`dump_config`)."""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping
from typing import Any

import attrs
import cattrs
from cattrs.errors import ForbiddenExtraKeysError

from marin_rl_core.config.schema import CHOICE_TYPES, PluginChoice, RLJobConfig
from marin_rl_core.errors import ConfigError, FieldValueError
from marin_rl_core.hookspecs import PluginRecord
from marin_rl_core.registry import Registry
from marin_rl_core.types import LessonConfig

# --- the converter -------------------------------------------------------------------------------


def _strict_scalar_hooks(converter: cattrs.Converter) -> None:
    """TOML and YAML carry types: ``kl_coef = "0.1"`` is a mistake, not a float."""

    def int_hook(value: Any, _: type) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"expected an integer, got {type(value).__name__} {value!r}")
        return value

    def float_hook(value: Any, _: type) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"expected a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"expected a finite number, got {value!r}")
        return float(value)

    def str_hook(value: Any, _: type) -> str:
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {type(value).__name__} {value!r}")
        return value

    def bool_hook(value: Any, _: type) -> bool:
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {type(value).__name__} {value!r}")
        return value

    def switch_hook(value: Any, _: type) -> bool | str:  # true, false or "auto"
        if not isinstance(value, bool | str):
            raise TypeError(f'expected true, false or "auto", got {type(value).__name__} {value!r}')
        return value

    converter.register_structure_hook(bool | str, switch_hook)
    converter.register_structure_hook(int, int_hook)
    converter.register_structure_hook(float, float_hook)
    converter.register_structure_hook(str, str_hook)
    converter.register_structure_hook(bool, bool_hook)


def make_converter(registry: Registry) -> cattrs.Converter:
    """The one converter for configs, aware of the loaded plugins' config classes.

    Build it after the registry: plugin sections (``[env]``, ``[loss]`` ...) structure into
    the config class of the plugin their ``name`` selects.
    """
    converter = cattrs.Converter(forbid_extra_keys=True)
    _strict_scalar_hooks(converter)

    def structure_mapping(value: Any, _: type) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a table, got {type(value).__name__}")
        return dict(value)

    converter.register_structure_hook_func(lambda t: t == Mapping[str, Any], structure_mapping)

    for kind, choice_cls in CHOICE_TYPES.items():
        converter.register_structure_hook(
            choice_cls, _choice_structure_hook(converter, registry, kind, choice_cls)
        )
        converter.register_unstructure_hook(choice_cls, _choice_unstructure_hook(converter))
    return converter


def _choice_structure_hook(converter, registry, kind, choice_cls):  # type: ignore[no-untyped-def]
    extra_fields = [f.name for f in attrs.fields(choice_cls) if f.name not in ("name", "config")]

    def hook(value: Any, _: type) -> PluginChoice:
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a table with a 'name' key, got {type(value).__name__}")
        value = dict(value)
        name = value.pop("name", choice_cls.default_name)
        if not isinstance(name, str):
            raise TypeError(f"'name' must be a string, got {type(name).__name__}")
        own = {k: value.pop(k) for k in extra_fields if k in value}
        record = registry.get(kind, name)  # names were checked in _check_plugin_names
        config = converter.structure(value, record.config_class)
        kwargs = {
            k: converter.structure(v, attrs.fields_dict(choice_cls)[k].type) for k, v in own.items()
        }
        return choice_cls(name=name, config=config, **kwargs)

    return hook


def _choice_unstructure_hook(converter):  # type: ignore[no-untyped-def]
    def hook(choice: PluginChoice) -> dict[str, Any]:
        out: dict[str, Any] = {"name": choice.name}
        if choice.config is not None:
            out.update(converter.unstructure(choice.config))
        for f in attrs.fields(type(choice)):
            if f.name not in ("name", "config"):
                out[f.name] = converter.unstructure(getattr(choice, f.name))
        return out

    return hook


# --- errors with paths ---------------------------------------------------------------------------


_FIELD_MARK = "\x00"


def format_structure_error(exc: Exception, raw: Mapping[str, Any], prefix: str = "$") -> str:
    lines = []
    for message in cattrs.transform_error(exc, path=prefix, format_exception=_format_exception):
        if message.startswith(_FIELD_MARK):  # a FieldValueError: report it at the field's path
            _, field, rest = message.split(_FIELD_MARK, 2)
            text, _, path = rest.rpartition(" @ ")
            message = f"{text} @ {path}.{field}"
        lines.append(f"  {message}")
    return "\n".join(lines)


def _format_exception(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, ForbiddenExtraKeysError):
        known = [f.name for f in attrs.fields(exc.cl)] if attrs.has(exc.cl) else []
        parts = []
        for key in sorted(exc.extra_fields):
            close = difflib.get_close_matches(key, known, n=1)
            parts.append(
                f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
            )
        return "; ".join(parts) + (f"; valid keys: {', '.join(known)}" if known else "")
    if isinstance(exc, KeyError):
        return "required key missing"
    if isinstance(exc, FieldValueError):
        return f"{_FIELD_MARK}{exc.field}{_FIELD_MARK}{exc}"
    type_name = (
        None
        if type_ is None
        else getattr(type_, "__name__", None) or str(type_).replace("typing.", "")
    )
    if isinstance(exc, TypeError | ValueError):
        return f"{exc} (expected {type_name})" if type_name else str(exc)
    return f"{type(exc).__name__}: {exc}"


def lesson_env_config(
    config: RLJobConfig, lesson: LessonConfig, registry: Registry
) -> tuple[str, Any]:
    """The env name and structured env config a lesson uses: the run's ``[env]`` config (when
    the lesson uses the same env) with the lesson's ``env_config`` overrides on top."""
    env_name = lesson.env or config.env.name
    record = registry.get("env", env_name)
    converter = make_converter(registry)
    base = converter.unstructure(config.env.config) if env_name == config.env.name else {}
    base.update(dict(lesson.env_config))
    return env_name, converter.structure(base, record.config_class)


# --- printing ------------------------------------------------------------------------------------


def unstructure_config(config: RLJobConfig, registry: Registry) -> dict[str, Any]:
    """Plain data in the shape a ``--config`` file takes (``None`` values left out)."""
    data = make_converter(registry).unstructure(config)
    return drop_none(data)


def drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [drop_none(v) for v in value]
    return value


def dump_config(config: RLJobConfig, registry: Registry, *, fmt: str = "toml") -> str:
    """The resolved config as TOML or YAML text that ``--config`` reads back unchanged."""
    data = unstructure_config(config, registry)
    if fmt == "toml":
        import tomli_w

        return tomli_w.dumps(data)
    if fmt in ("yaml", "yml"):
        import yaml

        return yaml.safe_dump(data, sort_keys=False)
    raise ConfigError(f"unknown format {fmt!r}; choose toml or yaml")


def check_config_class(record: PluginRecord, config: Any = None) -> Any:
    """The config class instantiates with no arguments and survives unstructure/structure
    through the strict run-config converter (so ``marinrl config show`` output reads back);
    so does ``config``, when given (an instance of the config class that a check then builds
    the plugin with, instead of the defaults). Returns the config the checks use."""
    from marin_rl_core.registry import build_registry

    try:
        default = record.config_class()
    except TypeError as exc:
        raise AssertionError(
            f"{record.kind} {record.name!r}: every field of {record.config_class.__name__} needs "
            f"a default ({exc})"
        ) from exc
    if config is None:
        config = default
    elif not isinstance(config, record.config_class):
        raise AssertionError(
            f"{record.kind} {record.name!r}: config must be a {record.config_class.__name__}, "
            f"got {type(config).__name__}"
        )
    converter = make_converter(build_registry(autoload=False))
    data = converter.unstructure(config)
    json.dumps(data)  # plain data only
    again = converter.structure(data, record.config_class)
    assert again == config, f"{record.config_class.__name__} does not round-trip: {again!r}"
    return config


__all__ = [
    "check_config_class",
    "dump_config",
    "lesson_env_config",
    "make_converter",
    "unstructure_config",
]
