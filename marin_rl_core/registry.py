"""Building the plugin registry: the one typed facade over the pluggy hooks.

:func:`build_registry` makes a fresh registry every time (there is no global plugin manager):
blocked names first, then the ``marinrl`` entry points, then explicit ``--plugin`` modules, then
``check_pending`` (a hookimpl that matches no hookspec is an error), then the registration hooks,
one plugin at a time so each record knows which distribution gave it, then duplicate detection.

Ray workers rebuild the driver's registry from :attr:`Registry.spec` and call
:meth:`Registry.verify` so they refuse to start on a different plugin set.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import pluggy

from marin_rl_core import hookspecs
from marin_rl_core.errors import (
    DuplicatePluginError,
    PluginContractError,
    PluginImportError,
    UnknownPluginError,
)
from marin_rl_core.hookspecs import PROJECT, RECORD_TYPES, REGISTRATION_HOOKS, PluginRecord

LOCAL = "(local module)"


@attrs.frozen(kw_only=True)
class RegisteredPlugin:
    """A record together with where it came from."""

    record: PluginRecord
    plugin: str
    """The plugin's name: its entry-point name, or the module path given to ``--plugin``."""
    distribution: str
    version: str

    @property
    def kind(self) -> str:
        return self.record.kind

    @property
    def name(self) -> str:
        return self.record.name

    def provider(self) -> str:
        return f"plugin {self.plugin!r} from {self.distribution} {self.version}".rstrip()


@attrs.frozen(kw_only=True)
class RegistrySpec:
    """Everything needed to rebuild a registry in another process, and what it must contain."""

    blocked: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    plugin_set: dict[str, dict[str, tuple[str, str]]] = attrs.field(factory=dict)


class Registry:
    """The plugins loaded for one run: look up records by kind and name."""

    def __init__(
        self,
        plugins: Sequence[RegisteredPlugin],
        *,
        blocked: Sequence[str] = (),
        extra: Sequence[str] = (),
        disabled: Sequence[str] = (),
        manager: pluggy.PluginManager | None = None,
    ):
        self._plugins = list(plugins)
        self._by_kind: dict[str, dict[str, RegisteredPlugin]] = {k: {} for k in RECORD_TYPES}
        for p in self._plugins:
            self._by_kind[p.kind][p.name] = p
        self.blocked = tuple(blocked)
        self.extra = tuple(extra)
        self.disabled = tuple(disabled)
        """Entry points that were installed but skipped because they were blocked."""
        self.manager = manager

    def names(self, kind: str) -> list[str]:
        return sorted(self._kind(kind))

    def entries(self, kind: str | None = None) -> list[RegisteredPlugin]:
        kinds = [kind] if kind else list(RECORD_TYPES)
        return [self._kind(k)[n] for k in kinds for n in sorted(self._kind(k))]

    def entry(self, kind: str, name: str, *, where: str | None = None) -> RegisteredPlugin:
        plugins = self._kind(kind)
        if name not in plugins:
            raise UnknownPluginError(kind, name, plugins, where=where, disabled=self.disabled)
        return plugins[name]

    def get(self, kind: str, name: str, *, where: str | None = None) -> PluginRecord:
        """The record registered as ``name`` for ``kind``; a clear error listing the names
        that exist (and the closest one) when there is none."""
        return self.entry(kind, name, where=where).record

    def build_engine(self, name: str, spec: Any, config: Any = None) -> Any:
        """The engine plugin ``name`` built with ``config`` (default: its config class's
        defaults) and ``spec`` (an :class:`~marin_rl_core.generation.EngineSpec`), whose
        ``build_engine(other)`` builds another registered engine the same way: how the
        ``auto`` engine builds the one it picks."""
        import attrs

        record = self.get("engine", name)
        spec = attrs.evolve(spec, build_engine=lambda other: self.build_engine(other, spec))
        return record.build(config if config is not None else record.config_class(), spec)

    @property
    def spec(self) -> RegistrySpec:
        plugin_set = {
            kind: {p.name: (p.distribution, p.version) for p in self.entries(kind)}
            for kind in RECORD_TYPES
        }
        return RegistrySpec(blocked=self.blocked, extra=self.extra, plugin_set=plugin_set)

    def verify(self, expected: dict[str, dict[str, tuple[str, str]]]) -> None:
        """Raise unless this registry holds exactly the plugins (and versions) of ``expected``."""
        actual = self.spec.plugin_set
        normalise = lambda d: {
            k: {n: tuple(v) for n, v in d.get(k, {}).items()} for k in RECORD_TYPES
        }  # noqa: E731
        expected_n, actual_n = normalise(expected), normalise(actual)
        if expected_n == actual_n:
            return
        diffs = []
        for kind in RECORD_TYPES:
            for name in sorted(set(expected_n[kind]) | set(actual_n[kind])):
                want, have = expected_n[kind].get(name), actual_n[kind].get(name)
                if want != have:
                    diffs.append(f"  {kind} {name!r}: driver has {want}, this worker has {have}")
        raise PluginContractError(
            "this worker's plugins differ from the driver's:\n" + "\n".join(diffs) + "\n"
            "Install the same plugin packages (and versions) on every node of the cluster."
        )

    def _kind(self, kind: str) -> dict[str, RegisteredPlugin]:
        if kind not in self._by_kind:
            raise UnknownPluginError("plugin kind", kind, self._by_kind)
        return self._by_kind[kind]


def _distribution_of_module(module_name: str) -> tuple[str, str]:
    top = module_name.split(".")[0]
    dists = metadata.packages_distributions().get(top, [])
    if dists:
        return dists[0], metadata.version(dists[0])
    return LOCAL, ""


def _load_entry_points(
    pm: pluggy.PluginManager, blocked: set[str]
) -> tuple[dict[str, tuple[str, str]], list[str]]:
    provenance: dict[str, tuple[str, str]] = {}
    disabled: list[str] = []
    for ep in sorted(metadata.entry_points(group=PROJECT), key=lambda e: e.name):
        dist = ep.dist.name if ep.dist is not None else "(unknown distribution)"
        version = ep.dist.version if ep.dist is not None else ""
        if ep.name in blocked:
            disabled.append(ep.name)
            continue
        if pm.get_plugin(ep.name) is not None:
            other = provenance.get(ep.name, ("?", ""))
            raise DuplicatePluginError(
                f"two installed packages declare a marinrl plugin named {ep.name!r}:\n"
                f"  {other[0]} {other[1]}\n  {dist} {version}\n"
                f"Uninstall one, or skip one with --disable-plugin {ep.name}."
            )
        try:
            module = ep.load()
        except Exception as exc:
            raise PluginImportError(
                f"plugin {ep.name!r} (entry point {ep.value!r} from {dist} {version}) failed to "
                f"import: {type(exc).__name__}: {exc}\n"
                f"Fix or reinstall {dist}, or run without it: --disable-plugin {ep.name}"
            ) from exc
        _register(pm, module, ep.name, f"{dist} {version}")
        provenance[ep.name] = (dist, version)
    return provenance, disabled


def _check_blocked_names(blocked: Sequence[str], extra: Sequence[str]) -> None:
    """A ``--disable-plugin`` name that names no installed plugin is a typo: say so, rather
    than run with the plugin the user meant to skip."""
    installed = {ep.name for ep in metadata.entry_points(group=PROJECT)}
    for name in blocked:
        if name not in installed and name not in extra:
            raise UnknownPluginError("plugin", name, installed, where="--disable-plugin")


def _register(pm: pluggy.PluginManager, module: Any, name: str, origin: str) -> None:
    try:
        pm.register(module, name=name)
    except pluggy.PluginValidationError as exc:
        raise PluginContractError(
            f"plugin {name!r} ({origin}) has an invalid hook implementation: {exc}\n"
            "Check the hook's signature in docs/hooks.md."
        ) from exc


def _check_pending(pm: pluggy.PluginManager, provenance: dict[str, tuple[str, str]]) -> None:
    known = sorted(n for n in dir(hookspecs) if n.startswith(PROJECT + "_"))
    for hook_name in dir(pm.hook):
        if not hook_name.startswith(PROJECT + "_"):
            continue
        caller = getattr(pm.hook, hook_name)
        if caller.spec is not None:
            continue
        for impl in caller.get_hookimpls():
            if impl.optionalhook:
                continue
            dist, version = provenance.get(impl.plugin_name, (LOCAL, ""))
            import difflib

            close = difflib.get_close_matches(hook_name, known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise PluginContractError(
                f"plugin {impl.plugin_name!r} ({dist} {version}) implements {hook_name!r}, "
                f"which matches no marinrl hookspec.{hint}\n"
                f"Known hooks: {', '.join(known)}. "
                f"Rename it, or disable the plugin with --disable-plugin {impl.plugin_name}."
            )
    pm.check_pending()  # anything we missed still fails loudly


def _collect_records(
    pm: pluggy.PluginManager, provenance: dict[str, tuple[str, str]]
) -> list[RegisteredPlugin]:
    found: dict[tuple[str, str], list[RegisteredPlugin]] = defaultdict(list)
    for kind, hook_name in REGISTRATION_HOOKS.items():
        record_type = RECORD_TYPES[kind]
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            dist, version = provenance.get(impl.plugin_name, (LOCAL, ""))
            origin = f"plugin {impl.plugin_name!r} ({dist} {version})".replace(" )", ")")
            try:
                records: Iterable[Any] = impl.function() or ()
                records = list(records)
            except Exception as exc:
                raise PluginContractError(
                    f"{origin} raised in {hook_name}: {type(exc).__name__}: {exc}\n"
                    f"Fix the plugin, or disable it with --disable-plugin {impl.plugin_name}."
                ) from exc
            for record in records:
                if not isinstance(record, record_type):
                    raise PluginContractError(
                        f"{origin}: {hook_name} must yield {record_type.__name__} records, "
                        f"got {type(record).__name__}."
                    )
                found[(kind, record.name)].append(
                    RegisteredPlugin(
                        record=record, plugin=impl.plugin_name, distribution=dist, version=version
                    )
                )
    for (kind, name), providers in found.items():
        if len(providers) > 1:
            lines = "\n".join(f"  - {p.provider()}" for p in providers)
            raise DuplicatePluginError(
                f"{len(providers)} plugins register the {kind} name {name!r}:\n{lines}\n"
                "Uninstall one, or disable one with --disable-plugin PLUGIN."
            )
    return [providers[0] for providers in found.values()]


def build_registry(
    *,
    autoload: bool = True,
    blocked: Iterable[str] = (),
    extra: Iterable[str] = (),
    modules: Iterable[Any] = (),
) -> Registry:
    """Build a fresh registry.

    Args:
        autoload: load the plugins installed under the ``marinrl`` entry-point group.
        blocked: plugin (entry-point) names to skip, as with ``--disable-plugin NAME``.
        extra: module paths to load as plugins, as with ``--plugin module.path``.
        modules: already-imported plugin modules or objects (for tests and embedding).

    Raises:
        PluginImportError, PluginContractError, DuplicatePluginError: see ``docs/cli.md``.
    """
    blocked, extra = tuple(blocked), tuple(extra)
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in blocked:
        pm.set_blocked(name)
    provenance: dict[str, tuple[str, str]] = {}
    disabled: list[str] = []
    if autoload:
        _check_blocked_names(blocked, extra)
        provenance, disabled = _load_entry_points(pm, set(blocked))
    for path in extra:
        if path in blocked:
            continue
        try:
            module = importlib.import_module(path)
        except Exception as exc:
            raise PluginImportError(
                f"plugin module {path!r} (given with --plugin) failed to import: "
                f"{type(exc).__name__}: {exc}\n"
                "Check the module path is importable (on PYTHONPATH or installed), or drop the "
                "--plugin flag."
            ) from exc
        if pm.is_registered(module):
            continue
        _register(pm, module, path, "given with --plugin")
        provenance[path] = _distribution_of_module(path)
    for obj in modules:
        name = getattr(obj, "__name__", None) or f"{type(obj).__name__}-{id(obj):x}"
        _register(pm, obj, name, "registered in code")
        provenance[name] = _distribution_of_module(name) if name in sys.modules else (LOCAL, "")
    _check_pending(pm, provenance)
    return Registry(
        _collect_records(pm, provenance),
        blocked=blocked,
        extra=extra,
        disabled=disabled,
        manager=pm,
    )


def registry_from_spec(spec: RegistrySpec) -> Registry:
    """Rebuild a driver's registry in a worker process and check it matches."""
    registry = build_registry(blocked=spec.blocked, extra=spec.extra)
    if spec.plugin_set:
        registry.verify(spec.plugin_set)
    return registry
