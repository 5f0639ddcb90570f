"""On the GPU image (jax 0.11): restore jax.core.is_constant_dim, which haliax uses and jax
0.11 removed."""

import operator

import jax.core


def _is_constant_dim(d) -> bool:
    try:
        operator.index(d)
        return True
    except Exception:
        return False


if not hasattr(jax.core, "is_constant_dim"):
    jax.core.is_constant_dim = _is_constant_dim
