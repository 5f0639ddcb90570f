"""A model's array leaves as weight transfer plugins see them: flattened with their paths,
described in JSON (path, dtype, shape), and checked against the receiving worker's model.

A client never builds anything from what a server says: it reads the bytes or arrays into the
structure and dtypes of its own ``like_model``, after checking that the server's description
matches it leaf for leaf.
"""

from __future__ import annotations

from typing import Any

from marin_rl_core.errors import WeightMismatchError


def array_leaves(model: Any) -> tuple[list[Any], Any, list[int], list[str]]:
    """Flatten ``model``: ``(all leaves, treedef, indices of the array leaves, their paths)``;
    ``jax.tree_util.tree_unflatten(treedef, leaves)`` rebuilds it."""
    import equinox as eqx
    import jax

    with_paths, treedef = jax.tree_util.tree_flatten_with_path(model)
    leaves = [leaf for _, leaf in with_paths]
    index = [i for i, leaf in enumerate(leaves) if eqx.is_array(leaf)]
    paths = [jax.tree_util.keystr(with_paths[i][0]) for i in index]
    return leaves, treedef, index, paths


def describe(arrays: list[Any], paths: list[str]) -> list[dict[str, Any]]:
    """JSON-able ``[{"path", "dtype", "shape"}, ...]`` of the array leaves."""
    return [
        {"path": p, "dtype": str(x.dtype), "shape": list(x.shape)}
        for p, x in zip(paths, arrays, strict=True)
    ]


def check_fits(served: Any, like: list[Any], paths: list[str], *, source: str, step: Any) -> None:
    """Raise :class:`WeightMismatchError` naming the first leaf where the server's description
    ``served`` differs from the array leaves ``like`` (at ``paths``) of the worker's model.
    ``source`` names the server, ``step`` the version, in the message."""
    mine = describe(like, paths)
    if served == mine:
        return
    if not isinstance(served, list) or len(served) != len(mine):
        count = len(served) if isinstance(served, list) else "no list of"
        detail = f"the server has {count} array leaves, like_model has {len(mine)}"
    else:
        k = next(k for k in range(len(mine)) if served[k] != mine[k])
        s, m = served[k], mine[k]
        s = s if isinstance(s, dict) else {}
        detail = (
            f"leaf {k} is {s.get('path')} {s.get('dtype')}{s.get('shape')} on the server but "
            f"{m['path']} {m['dtype']}{m['shape']} in like_model"
        )
    raise WeightMismatchError(
        f"weights from {source} (step {step}) do not fit like_model: {detail}. Build like_model "
        "with the trainer's model config."
    )
