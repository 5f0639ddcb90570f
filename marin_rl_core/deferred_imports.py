"""Modules that levanter imports when it is imported but that a job's processes rarely use,
imported on first use instead: half a second off the start of every trainer and rollout worker.

``import levanter`` imports ``datasets`` (levanter uses it only to read Hugging Face datasets),
pandas (through ``datasets`` and ``deepdiff``, which uses it only to hash data frames) and
``transformers.models``, whose package ``__init__`` reads the ``__all__`` of some 1,400 model
files to build its lazy index (levanter's checkpoint converter only needs
``transformers.models.auto`` and a model family's own package). Together 0.7 s of the 3.5 s a
process spent importing (2-core machine, 2026-12-01). :func:`defer` puts a stand-in in their
place when something imports them: it answers for its submodules (``transformers.models.auto``
imports as usual) and imports the real module the first time anything else is asked of it
(``datasets.load_dataset``, ``transformers.models.MODEL_NAMES``), after which it is that module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from typing import Any

DEFERRED = ("datasets", "pandas", "transformers.models")
"""What :func:`defer` defers."""

_lock = threading.RLock()
_IMPORT_PROBES = frozenset(
    ("__path__", "__file__", "__cached__", "__loader__", "__spec__", "__package__", "__builtins__")
)


class DeferredModule(types.ModuleType):
    """The stand-in: a package whose ``__path__`` is the real one's, so its submodules import
    as usual; any other attribute imports the real module (once) and is read from it."""

    def __getattr__(self, name: str) -> Any:
        if name in _IMPORT_PROBES:
            raise AttributeError(name)  # what the import system looks for: not a use
        path = self.__dict__.get("__path__")
        if path and importlib.machinery.PathFinder.find_spec(f"{self.__name__}.{name}", path):
            return importlib.import_module(f"{self.__name__}.{name}")
        return getattr(_load(self), name)


def _load(stand_in: DeferredModule) -> types.ModuleType:
    """The real module of ``stand_in``, imported now (once) in its place in ``sys.modules``."""
    name = stand_in.__name__
    with _lock:
        real = sys.modules.get(name)
        if real is None or real is stand_in:
            _Finder.loading.add(name)
            try:
                sys.modules.pop(name, None)
                real = importlib.import_module(name)
            except BaseException:
                sys.modules[name] = stand_in
                raise
            finally:
                _Finder.loading.discard(name)
        # Submodules imported through the stand-in are the real module's too.
        for key, value in list(stand_in.__dict__.items()):
            if isinstance(value, types.ModuleType) and key not in real.__dict__:
                setattr(real, key, value)
        stand_in.__dict__.update(real.__dict__)
        parent, _, child = name.rpartition(".")
        if parent and isinstance(sys.modules.get(parent), types.ModuleType):
            try:
                setattr(sys.modules[parent], child, real)
            except AttributeError:
                pass
    return real


class _Loader(importlib.abc.Loader):
    def __init__(self, real: importlib.machinery.ModuleSpec):
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = DeferredModule(spec.name)
        module.__file__ = self.real.origin
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing: the real module runs on first use."""


class _Finder(importlib.abc.MetaPathFinder):
    """Answers the import of a deferred module (not yet imported) with a stand-in."""

    loading: set[str] = set()

    def __init__(self, names: tuple[str, ...]):
        self.names = frozenset(names)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in self.names or name in self.loading:
            return None
        real = importlib.machinery.PathFinder.find_spec(name, path)
        if real is None:
            return None  # not installed: the import fails as it would have
        package = real.submodule_search_locations is not None
        spec = importlib.util.spec_from_loader(
            name, _Loader(real), origin=real.origin, is_package=package
        )
        if spec is not None and package:
            spec.submodule_search_locations = list(real.submodule_search_locations or [])
        return spec


def defer(names: tuple[str, ...] = DEFERRED) -> None:
    """From now on, these modules (those not imported yet) are imported on first use.

    Called by the processes marinrl starts (a job's Ray workers, the ``marinrl`` command)
    before anything imports levanter; idempotent."""
    with _lock:
        if any(isinstance(f, _Finder) for f in sys.meta_path):
            return
        pending = tuple(n for n in names if n not in sys.modules)
        if pending:
            sys.meta_path.insert(0, _Finder(pending))
