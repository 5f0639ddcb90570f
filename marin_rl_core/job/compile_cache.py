"""JAX's persistent compilation cache, on by default (``compilation_cache`` in the run config).

A second run of the same job loads its compiled training step and sampler from disk instead of
compiling them again, which is most of a small job's start-up. Entries are XLA executables
written by JAX itself, keyed by the program, the devices and the JAX version; like any compiled
cache they must come from a directory only you write to (the default is under your home).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_dir(setting: str) -> Path | None:
    """The directory ``compilation_cache`` names (``None``: off); see ``RLJobConfig``."""
    if not setting:
        return None
    if setting != "auto":
        return Path(setting).expanduser()
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "marinrl" / "jax"


def enable(setting: str) -> Path | None:
    """Point this process's JAX at the cache (before anything compiles); returns the directory.

    Every compiled function is cached however quickly it compiled: a small job's many small
    functions add up to most of its start-up. A directory that cannot be created turns the cache
    off with a warning rather than failing the run.
    """
    path = cache_dir(setting)
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        logger.warning("compilation cache off: cannot create %s (%s)", path, exc)
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    logger.info("JAX compilation cache: %s", path)
    return path
