"""Trainer checkpoints: model, optimizer state and run state, written atomically.

Layout inside ``RUN_DIR/checkpoints/``::

    step-000050/  model.eqx  opt_state.eqx  state.json   (curriculum state, step, replay stats)
    latest        the name of the newest complete checkpoint

Arrays are stored with ``equinox.tree_serialise_leaves`` (``.npy`` data, no pickle) and read back
into a template of the same structure, so nothing executable is ever loaded. A checkpoint
directory is written under a temporary name and renamed when complete: a crash mid-write never
leaves a checkpoint that looks whole.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

CHECKPOINT_DIR = "checkpoints"


def _root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: Any,
    opt_state: Any = None,
    state: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` and keep the newest ``keep`` of them. Returns its directory."""
    import equinox as eqx

    root = _root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    eqx.tree_serialise_leaves(tmp / "model.eqx", model)
    if opt_state is not None:
        eqx.tree_serialise_leaves(tmp / "opt_state.eqx", opt_state)
    (tmp / "state.json").write_text(json.dumps({"step": step, **(state or {})}, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or ``None``."""
    root = _root(run_dir)
    marker = root / "latest"
    if marker.exists():
        path = root / marker.read_text().strip()
        if (path / "state.json").exists():
            return path
    complete = [p for p in sorted(root.glob("step-*")) if (p / "state.json").exists()]
    return complete[-1] if complete else None


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint directory or a run directory (meaning its latest checkpoint)."""
    path = Path(path)
    if (path / "model.eqx").exists():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(
            f"no checkpoint in {path} (expected {path}/{CHECKPOINT_DIR}/step-*)"
        )
    return found


def load_model(checkpoint: str | Path, like: Any) -> Any:
    """Read a checkpoint's model into a template of the same structure."""
    import equinox as eqx

    return eqx.tree_deserialise_leaves(Path(checkpoint) / "model.eqx", like)


def load_checkpoint(
    checkpoint: str | Path, *, model_like: Any, opt_state_like: Any = None
) -> tuple[Any, Any, dict[str, Any]]:
    """Read ``(model, opt_state, state)``; ``opt_state`` is ``None`` when not asked for."""
    import equinox as eqx

    checkpoint = Path(checkpoint)
    model = load_model(checkpoint, model_like)
    opt_state = None
    if opt_state_like is not None and (checkpoint / "opt_state.eqx").exists():
        opt_state = eqx.tree_deserialise_leaves(checkpoint / "opt_state.eqx", opt_state_like)
    state = json.loads((checkpoint / "state.json").read_text())
    return model, opt_state, state
