"""The ``ppo`` loss's critic and GAE (imported by :mod:`marin_rl_plugins.ppo` when a run
builds its loss, so that importing the plugin pulls in no JAX)."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray


class ValueHead(eqx.Module):
    """A linear value head: ``V = hidden . weight + bias`` in float32, ``[..., position]`` from
    hidden states ``[..., position, embed]``. Starts at zero (every value 0)."""

    weight: NamedArray
    bias: jax.Array

    @staticmethod
    def init(embed: hax.Axis) -> ValueHead:
        return ValueHead(
            weight=hax.zeros(embed, dtype=jnp.float32), bias=jnp.zeros((), jnp.float32)
        )

    def __call__(self, hidden: NamedArray) -> jax.Array:
        h = hidden.astype(jnp.float32)
        return hax.dot(h, self.weight, axis=self.weight.axes[0]).array + self.bias


class Critic(eqx.Module):
    """A value function as trainable loss state: ``head`` on the policy's own hidden states
    (``trunk`` None), or on a separate ``trunk`` model's."""

    trunk: Any
    head: ValueHead


def gae(
    rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    segment_ids: jax.Array | None,
    *,
    gamma: float,
    lam: float,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over each rollout's actions: ``(advantages, returns)``,
    ``[batch, position]``, 0 outside the mask.

    The time steps are the masked positions (the tokens the policy sampled) of one rollout, in
    order; positions between them (a multi-turn rollout's observations) are skipped, and each
    rollout ends with a value of 0 after its last action. For consecutive actions ``t`` and
    ``t'``::

        delta_t = r_t + gamma * V_t' - V_t
        A_t     = delta_t + gamma * lam * A_t'
        R_t     = A_t + V_t

    ``rewards`` are per action (``TrainingBatch.token_rewards``); ``values`` are the critic's,
    taken as constants (stop-gradient)."""
    values = jax.lax.stop_gradient(values)
    width = values.shape[-1]
    segments = jnp.zeros(values.shape, jnp.int32) if segment_ids is None else segment_ids

    def step(carry: tuple[jax.Array, ...], xs: tuple[jax.Array, ...]) -> Any:
        next_value, next_advantage, next_segment = carry
        r, v, m, seg = xs
        same = seg == next_segment  # a new rollout starts after this position: no bootstrap
        next_value = jnp.where(same, next_value, 0.0)
        next_advantage = jnp.where(same, next_advantage, 0.0)
        delta = r + gamma * next_value - v
        advantage = delta + gamma * lam * next_advantage
        acting = m > 0
        carry = (
            jnp.where(acting, v, next_value),
            jnp.where(acting, advantage, next_advantage),
            seg,
        )
        return carry, jnp.where(acting, advantage, 0.0)

    rows = values.shape[:-1]
    init = (jnp.zeros(rows), jnp.zeros(rows), jnp.full(rows, -2, jnp.int32))
    xs = tuple(jnp.moveaxis(x, -1, 0) for x in (rewards, values, mask, segments))
    _, advantages = jax.lax.scan(step, init, xs, reverse=True, length=width)
    advantages = jnp.moveaxis(advantages, 0, -1)
    returns = jnp.where(mask > 0, advantages + values, 0.0)
    return advantages, returns
