"""Modules that levanter imports when it is imported but that a job's processes rarely use,
imported on first use instead: 0.7 s off the start of every trainer and rollout worker.

``import levanter`` imports ``datasets`` (levanter uses it only to read Hugging Face datasets),
pandas (through ``datasets`` and ``deepdiff``, which uses it only to hash data frames) and
``transformers.models``, whose package ``__init__`` reads the ``__all__`` of some 1,400 model
files to build its lazy index (levanter's checkpoint converter only needs
``transformers.models.auto`` and a model family's own package). Together 0.7 s of the 3.4 s a
trainer process spent importing (2-core machine, 2026-12-01).

:func:`defer` puts a stand-in (:class:`DeferredModule`) in their place when something imports
them. The first use of the stand-in (an attribute: ``datasets.load_dataset``, ``dir(pandas)``)
imports the real module, which takes its place; so does importing one of its submodules
(``pandas.core.frame``, as unpickling a data frame does), which then runs with its package
imported, as always. ``transformers.models`` alone lets its submodules import without the
package (``transformers.models.auto``, ``transformers.models.llama``): its ``__init__`` only
builds the index of their names.

``import transformers`` builds that index of its model files' names too (for its lazy top-level
names: ``from transformers import LlamaConfig``): 0.3 s of reading the 1,400 files' sources in
every process that imports levanter. :func:`defer` has transformers' ``define_import_structure``
keep each index it builds in marinrl's cache (``index_cache_dir()``, JSON) and read it there
in later processes, as long as no file of the indexed directory changed (their names, sizes
and times are the key); anything in the cache that is not an index of the expected shape is
built again.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFERRED = {"datasets": False, "pandas": False, "transformers.models": True}
"""What :func:`defer` defers, each with whether its submodules import without it."""

_lock = threading.RLock()
_IMPORT_PROBES = frozenset(
    ("__path__", "__file__", "__cached__", "__loader__", "__spec__", "__package__", "__builtins__")
)


class DeferredModule(types.ModuleType):
    """The stand-in for a module not imported yet; any use imports it (see the module
    docstring)."""

    _submodules_alone = False

    def __getattr__(self, name: str) -> Any:
        if name in _IMPORT_PROBES:
            raise AttributeError(name)  # what the import system looks for: not a use
        path = self.__dict__.get("__path__")
        if (
            self._submodules_alone
            and path
            and importlib.machinery.PathFinder.find_spec(f"{self.__name__}.{name}", path)
        ):
            return importlib.import_module(f"{self.__name__}.{name}")
        return getattr(_load(self), name)

    def __dir__(self) -> list[str]:
        return dir(_load(self))


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
    def __init__(self, real: importlib.machinery.ModuleSpec, submodules_alone: bool):
        self.real, self.submodules_alone = real, submodules_alone

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = DeferredModule(spec.name)
        module.__file__ = self.real.origin
        module._submodules_alone = self.submodules_alone
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing: the real module runs on first use."""


class _Imported(importlib.abc.Loader):
    """The loader of a module already imported: hands it over, and gives it its spec back."""

    def __init__(self, module: types.ModuleType, spec: Any):
        self.module, self.spec = module, spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self.spec


def _as_imported(module: types.ModuleType) -> importlib.machinery.ModuleSpec:
    """A spec for ``module`` (imported already) that the import system takes as it is: set as
    its ``__spec__`` until then (the import system uses the ``__spec__`` of a module that a
    finder imported)."""
    real = module.__spec__
    spec = importlib.machinery.ModuleSpec(
        module.__name__, _Imported(module, real), origin=getattr(real, "origin", None)
    )
    module.__spec__ = spec
    return spec


class _Finder(importlib.abc.MetaPathFinder):
    """Answers the import of a deferred module (not yet imported) with a stand-in, and the
    import of a submodule of a stand-in that must not import alone by importing it first."""

    loading: set[str] = set()

    def __init__(self, deferred: dict[str, bool]):
        self.deferred = dict(deferred)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name in self.loading:
            return None
        for package, alone in self.deferred.items():
            if name.startswith(package + ".") and not alone:
                stand_in = sys.modules.get(package)
                if not isinstance(stand_in, DeferredModule):
                    return None
                _load(stand_in)
                imported = sys.modules.get(name)
                # Not imported by its package: found as usual. Imported: the import system
                # would run it again from its spec (it looked up the parent before), unless the
                # spec hands over the module as it is.
                return None if imported is None else _as_imported(imported)
        if name not in self.deferred:
            return None
        real = importlib.machinery.PathFinder.find_spec(name, path)
        if real is None:
            return None  # not installed: the import fails as it would have
        package = real.submodule_search_locations is not None
        spec = importlib.util.spec_from_loader(
            name, _Loader(real, self.deferred[name]), origin=real.origin, is_package=package
        )
        if spec is not None and package:
            spec.submodule_search_locations = list(real.submodule_search_locations or [])
        return spec


def defer(deferred: dict[str, bool] | None = None) -> None:
    """From now on, these modules (those not imported yet) are imported on first use;
    ``deferred`` maps each name to whether its submodules import without it (default:
    :data:`DEFERRED`).

    Called by the processes marinrl starts (a job's Ray workers, the ``marinrl`` command)
    before anything imports levanter; idempotent."""
    with _lock:
        if any(isinstance(f, _Finder | _IndexFinder) for f in sys.meta_path):
            return
        pending = {n: a for n, a in (deferred or DEFERRED).items() if n not in sys.modules}
        if pending:
            sys.meta_path.insert(0, _Finder(pending))
        _keep_transformers_index()


# --- transformers' index of its model files, kept between processes -------------------------

_INDEXER = "transformers.utils.import_utils"
_INDEX_FUNCTION = "define_import_structure"


def index_cache_dir() -> Path:
    """Where :func:`defer` keeps transformers' indexes: ``$MARINRL_CACHE_DIR/transformers-index``
    (default ``~/.cache/marinrl/transformers-index``)."""
    from marin_rl_core.rundir import cache_dir

    return cache_dir("transformers-index")


def _index_key(module_path: Any, prefix: str | None) -> str:
    """What an index depends on: the indexing code's file and every file under the directory
    indexed (names, sizes, modification times)."""
    root = Path(module_path)
    files = []
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            stat = os.stat(os.path.join(folder, name))
            files.append([os.path.relpath(os.path.join(folder, name), root), stat.st_size,
                          stat.st_mtime_ns])  # fmt: skip
    indexer = sys.modules.get(_INDEXER)
    code = getattr(indexer, "__file__", None)
    code_stat = [code, os.stat(code).st_size, os.stat(code).st_mtime_ns] if code else None
    key = [str(root.resolve()), prefix, code_stat, files]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]


def _read_index(path: Path) -> dict[frozenset[str], dict[str, set[str]]] | None:
    """The index kept at ``path``: ``{backends: {module: names}}``; ``None`` when there is none
    or it is not one (built again)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    strings = lambda xs: isinstance(xs, list) and all(isinstance(x, str) for x in xs)  # noqa: E731
    if not isinstance(data, list):
        return None
    index: dict[frozenset[str], dict[str, set[str]]] = {}
    for entry in data:
        if not (isinstance(entry, list) and len(entry) == 2 and strings(entry[0])):
            return None
        backends, modules = entry
        if not isinstance(modules, dict) or not all(strings(v) for v in modules.values()):
            return None
        index[frozenset(backends)] = {module: set(names) for module, names in modules.items()}
    return index


def _write_index(path: Path, index: dict[frozenset[str], dict[str, set[str]]]) -> None:
    data = [[sorted(b), {m: sorted(n) for m, n in mods.items()}] for b, mods in index.items()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(data))
        os.replace(partial, path)
    except OSError:
        pass  # (a cache that cannot be written: built again next time)


def kept_index(build: Callable[..., Any]) -> Callable[..., Any]:
    """``build`` (transformers' ``define_import_structure(module_path, prefix=None)``) reading
    and keeping its indexes in :func:`index_cache_dir`."""

    @functools.wraps(build)
    def define_import_structure(module_path: Any, prefix: str | None = None) -> Any:
        try:
            path = index_cache_dir() / f"{_index_key(module_path, prefix)}.json"
        except OSError:
            return build(module_path, prefix)
        index = _read_index(path)
        if index is None:
            index = build(module_path, prefix)
            _write_index(path, index)
        return index

    define_import_structure.__marinrl_kept__ = True  # type: ignore[attr-defined]
    return define_import_structure


def _keep(indexer: types.ModuleType) -> None:
    build = getattr(indexer, _INDEX_FUNCTION, None)
    if callable(build) and not getattr(build, "__marinrl_kept__", False):
        setattr(indexer, _INDEX_FUNCTION, kept_index(build))


class _IndexFinder(importlib.abc.MetaPathFinder):
    """Finds transformers' indexing module as usual (and then leaves ``sys.meta_path``) and has
    :func:`kept_index` wrap its ``define_import_structure`` once it has run (before
    ``transformers/__init__`` calls it)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _INDEXER:
            return None
        with _lock:
            if self in sys.meta_path:  # once: nothing else to find
                sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = getattr(spec, "loader", None)
        if spec is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            _keep(module)

        loader.exec_module = exec_module  # type: ignore[union-attr]
        return spec


def _keep_transformers_index() -> None:
    if _INDEXER in sys.modules:
        _keep(sys.modules[_INDEXER])  # imported already: later indexes (transformers.models)
    else:
        sys.meta_path.insert(0, _IndexFinder())
