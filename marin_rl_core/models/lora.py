"""Low-rank adapters (LoRA) on the policy, on levanter's own (:mod:`levanter.lora`).

levanter's ``loraize`` wraps each targeted ``haliax.nn.Linear`` in a ``LoraLinear`` (the frozen
layer plus a ``LowRankLinear`` of ``lora_A`` and ``lora_B``), scan-stacked layers included. It
draws both factors at random, so a fresh levanter LoRA model is not its base model: RL starts
from the base, so :func:`add_adapters` zeroes ``lora_B`` (PEFT's init) and step 0's policy
computes exactly what the base computes.

What the rest of marinrl uses:

* :func:`add_adapters`: the base model with adapters on the layers ``[model.lora]`` targets.
* :func:`trainable_filter`: levanter's ``is_trainable`` filter tree (the adapters), for the
  trainer state and the train step's gradients.
* :func:`merged`: the plain model with each adapter added into its layer's weight (what rollout
  workers apart from the trainer sample from and ``marinrl export`` writes).
* :func:`sampled_in_place`: what a colocated sampler samples from: the policy unmerged, on the
  trainer's own base arrays (every engine applies the adapters as the trainer does).
* :func:`without_adapters`: the base model inside a LoRA model, the same arrays with the
  adapters left out (a loss's KL reference: no copy).
* :func:`adapters_of` and :class:`AdaptedBase`: what a trainer publishes to samplers apart from
  it (the adapters alone), and a sampler's base, loaded once, that each version received is
  merged into.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from levanter.lora import LoraLinear, LowRankLinear, is_lora_param

from marin_rl_core.errors import ConfigError

if TYPE_CHECKING:
    from marin_rl_core.config.schema import LoraConfig


def _is_lora_layer(node: Any) -> bool:
    return isinstance(node, LoraLinear)


def has_adapters(model: Any) -> bool:
    """Whether ``model`` (or any part of it) carries LoRA adapters."""
    return any(_is_lora_layer(node) for node in jax.tree.leaves(model, is_leaf=_is_lora_layer))


def linear_names(model: Any) -> list[str]:
    """The attribute names of ``model``'s linear layers (``q_proj``, ``gate_proj``, ...): what
    ``[model.lora].targets`` may name."""
    import haliax.nn as hnn
    from levanter.utils.jax_utils import leaf_key_paths

    def is_linear(node: Any) -> bool:
        return isinstance(node, hnn.Linear | hnn.Stacked)

    names: set[str] = set()

    def visit(tree: Any, prefix: str) -> None:
        paths = leaf_key_paths(tree, is_leaf=is_linear, prefix=prefix)
        for node, path in zip(
            jax.tree.leaves(tree, is_leaf=is_linear), jax.tree.leaves(paths), strict=True
        ):
            if isinstance(node, hnn.Stacked):
                visit(node.stacked, f"{path}.stacked")
            elif isinstance(node, hnn.Linear):
                names.add(path.rsplit(".", 1)[-1])

    visit(model, "")
    return sorted(names)


def add_adapters(model: Any, lora: LoraConfig, *, key: jax.Array) -> Any:
    """``model`` with rank-``lora.rank`` adapters on its ``lora.targets`` layers: ``lora_A``
    drawn from ``key``, ``lora_B`` zero, so that it computes what ``model`` computes. Raises
    :class:`~marin_rl_core.errors.ConfigError` for a target no layer of the model has."""
    import levanter.lora

    known = linear_names(model)
    missing = [t for t in lora.targets if t not in known]
    if missing or not lora.targets:
        raise ConfigError(
            f"$.model.lora.targets: {', '.join(missing) or '(none)'} is not a linear layer of "
            f"this model; its linear layers are {', '.join(known)}"
        )
    config = levanter.lora.LoraConfig(
        target_modules=[f".{t}" for t in lora.targets],
        r=lora.rank,
        alpha=lora.scale * lora.rank,
        dropout=lora.dropout,
    )
    adapted = levanter.lora.loraize(model, config, key)

    def zero_b(node: Any) -> Any:
        if isinstance(node, LowRankLinear):
            return eqx.tree_at(lambda n: n.lora_B.weight, node, node.lora_B.weight * 0)
        return node

    return jax.tree.map(zero_b, adapted, is_leaf=is_lora_param)


def trained_policy_like(config: Any, tokenizer: Any) -> Any:
    """A model of the structure a run of ``config`` trains (its initial policy, with adapters
    when ``[model.lora]`` has a rank): what a checkpoint's policy is read into."""
    from marin_rl_core.models.build import initial_model

    model = initial_model(config, tokenizer)
    if config.model.lora.enabled:
        model = add_adapters(model, config.model.lora, key=jax.random.PRNGKey(config.seed + 3))
    return model


def trainable_filter(model: Any) -> Any:
    """levanter's ``is_trainable`` filter tree for the LoRA policy ``model``: ``True`` at its
    adapters, ``False`` at every base weight."""
    from levanter.lora import lora_trainable_params_filter

    return lora_trainable_params_filter(model)


def saved_part(tree: Any, is_trainable: Any) -> Any:
    """levanter's mask of what a LoRA run's checkpoint of ``tree`` (a ``TrainerState``, or a
    model when ``is_trainable`` is its own filter) holds: everything but the frozen base."""
    from levanter.trainer_state import make_floating_point_trainable_filter, saveable_training_mask

    if hasattr(tree, "opt_state"):
        return saveable_training_mask(tree, is_trainable)
    return make_floating_point_trainable_filter(is_trainable)


def merged(model: Any) -> Any:
    """``model`` with every adapter added into its layer's weight (``W + scale * B A``, in
    ``W``'s dtype and axis order) and the adapters gone: a plain model of the base's structure,
    in new buffers. A model without adapters is returned as it is."""
    if not has_adapters(model):
        return model
    return _merge_jit(model)


def _merge(model: Any) -> Any:
    def merge(node: Any) -> Any:
        if not _is_lora_layer(node):
            return node
        weight = node.wrapped.weight
        delta = node.lora.merge().rearrange(weight.axes)
        return eqx.tree_at(lambda n: n.weight, node.wrapped, weight + delta.astype(weight.dtype))

    return jax.tree.map(merge, model, is_leaf=_is_lora_layer)


_merge_jit = eqx.filter_jit(_merge)


def without_adapters(model: Any) -> Any:
    """The base model inside ``model``: every adapted layer as it was before its adapter (the
    same arrays, nothing copied)."""
    return jax.tree.map(
        lambda node: node.wrapped if _is_lora_layer(node) else node,
        model,
        is_leaf=_is_lora_layer,
    )


def sampled_in_place(model: Any, dtype: Any) -> Any:
    """What a colocated sampler is handed of the LoRA policy ``model``: the policy unmerged,
    with no dropout (:func:`without_dropout`), its adapters copied in ``dtype`` (the next train step
    donates the trainer's), its base the trainer's very arrays (no train step donates or
    replaces them: :class:`~marin_rl_core.learner.levanter_step.StepJit`), cast only where
    ``dtype`` is not theirs. No copy of the base is made, and the sampler computes what the
    trainer computes (adapters applied, not merged)."""
    from marin_rl_core.models.build import cast_floating, publish_copy

    adapters, base = eqx.partition(model, trainable_filter(model))
    return without_dropout(eqx.combine(publish_copy(adapters, dtype), cast_floating(base, dtype)))


class NoDropout(eqx.Module):
    """A sampled adapter's dropout: none, and no leaf (haliax's ``Dropout`` holds its
    ``inference`` flag as a bool leaf, which the engines' layer loops would try to slice)."""

    @property
    def is_active(self) -> bool:
        return False

    def __call__(self, x: Any, *, key: Any = None, inference: Any = None) -> Any:
        return x


def without_dropout(model: Any) -> Any:
    """``model`` (with adapters) as the engines sample it: every adapter's dropout off."""

    def off(node: Any) -> Any:
        if isinstance(node, LowRankLinear):
            return eqx.tree_at(lambda n: n.dropout, node, NoDropout())
        return node

    return jax.tree.map(off, model, is_leaf=lambda n: isinstance(n, LowRankLinear))


def adapters_of(model: Any) -> Any:
    """The adapters of the LoRA policy ``model`` alone (every base weight ``None``): what a
    trainer publishes to samplers that hold the base themselves."""
    return eqx.filter(model, trainable_filter(model))


class AdaptedBase:
    """A sampler's side of a LoRA job whose trainer publishes the adapters alone: the base model
    loaded once, and the structure (and dtype) of the adapters it receives. Each version
    received becomes a plain model by :meth:`merged` (the base is kept: merging into the
    previous merge would drift with rounding)."""

    def __init__(self, base: Any, lora: LoraConfig, *, dtype: Any, key: jax.Array):
        from marin_rl_core.models.build import cast_floating

        adapted = cast_floating(add_adapters(base, lora, key=key), dtype)
        self.like, self.base = eqx.partition(adapted, trainable_filter(adapted))
        """``like``: the adapters' structure, what a weight client receives into."""

    def merged(self, adapters: Any) -> Any:
        """The base with ``adapters`` (received, of :attr:`like`'s structure) merged in."""
        return merged(eqx.combine(adapters, self.base))


def parameter_count(tree: Any) -> int:
    """How many numbers ``tree``'s floating-point arrays hold (or would: ``jax.eval_shape``'s
    ``ShapeDtypeStruct`` leaves count as the arrays they describe)."""
    return sum(
        math.prod(x.shape)
        for x in jax.tree.leaves(tree)
        if isinstance(x, jax.ShapeDtypeStruct | jax.Array | np.ndarray)
        and jnp.issubdtype(x.dtype, jnp.floating)
    )


def adapter_parameter_count(model: Any) -> int:
    """How many numbers ``model``'s adapters hold (0 without adapters)."""
    return parameter_count(eqx.filter(model, trainable_filter(model)))
