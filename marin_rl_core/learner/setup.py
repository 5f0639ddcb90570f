"""What the trainer trains, set up before its first step: the policy (with LoRA adapters when
``[model.lora]`` has a rank: :mod:`~marin_rl_core.models.lora`), the loss plugin built with
its KL reference, the loss's own trainable state (a critic), and the
:class:`~marin_rl_core.learner.step.Learner` told which parameters train."""

from __future__ import annotations

from typing import Any

from marin_rl_core.config.schema import RLJobConfig
from marin_rl_core.learner.loss import TrainedModel, loss_plan, policy_of, with_loss_state
from marin_rl_core.learner.step import Learner, plugin_loss_fn, plugin_prepare_fn
from marin_rl_core.models.lora import trainable_filter, trained_policy_like, without_adapters
from marin_rl_core.registry import Registry


def trained_filter(model: Any) -> Any:
    """levanter's ``is_trainable`` filter of what a LoRA run trains: the policy's adapters
    (:func:`~marin_rl_core.models.lora.trainable_filter`) and all of a loss's own state."""
    import jax

    if isinstance(model, TrainedModel):
        return TrainedModel(
            policy=trainable_filter(model.policy),
            loss_state=jax.tree.map(lambda _: True, model.loss_state),
        )
    return trainable_filter(model)


def set_up_training(
    config: RLJobConfig, registry: Registry, tokenizer: Any, *, run_id: str
) -> tuple[Learner, Any, Any]:
    """``(learner, loss, model)``: the learner with the loss set, the built loss plugin, and the
    model to train (the initial policy, with adapters and with the loss's state as the config
    and loss ask), from which the trainer state is made.

    The KL reference (a loss that ``needs_reference_model``) is a frozen copy of the initial
    policy in compute precision, sharded like it; with LoRA it is the base inside the policy,
    adapters off: no copy."""
    import equinox as eqx
    import jax

    # With [model.lora], adapters on the base (zero at first: step 0's policy is the base).
    model = trained_policy_like(config, tokenizer)
    lora = config.model.lora.enabled
    loss = registry.get("loss", config.loss.name).build(config.loss.config)
    learner = Learner(config.trainer, hf_checkpoint=bool(config.model.checkpoint), run_id=run_id)
    reference = None
    reference_of = (lambda m: without_adapters(policy_of(m))) if lora else None
    if loss.needs_reference_model and not lora:
        # (a real copy: the train step donates the policy's buffers)
        reference = learner.shard(
            learner.mp.cast_to_compute(
                jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, model)
            )
        )
    module = loss.build(reference)
    # What the loss asks of the trainer, read here once (protocols.LossPlan).
    plan = loss_plan(module)
    # A critic (or other trainable loss state) is trained, sharded and checkpointed with the
    # policy; never published or exported.
    model, state_lr = with_loss_state(
        plan, model, key=jax.random.PRNGKey(config.seed + 2),
        learning_rate=config.trainer.learning_rate,
    )  # fmt: skip
    # Several updates per step (PPO's epochs x minibatches), a frozen policy at first (value
    # pretraining): the learning-rate schedule counts updates.
    learner.set_loss(
        plugin_loss_fn(module, reference_of),
        reference=reference,
        state_learning_rate=state_lr,
        prepare_fn=plugin_prepare_fn(plan, reference_of),
        plan=plan,
        is_trainable=trained_filter(model) if lora else True,
    )
    return learner, module, model


def parameter_figures(state: Any, is_trainable: Any) -> dict[str, float]:
    """What a trainer state trains, for the log and the first ``train`` row:
    ``params/total`` (the policy's parameters, a LoRA policy's base and adapters),
    ``params/trainable`` (those with gradients and optimizer state, a loss's own state
    included) and ``params/optimizer_state_bytes``."""
    import equinox as eqx
    import jax

    from marin_rl_core.models.lora import parameter_count

    arrays = [x for x in jax.tree.leaves(state.opt_state) if eqx.is_array(x)]
    return {
        "params/total": float(parameter_count(policy_of(state.model))),
        "params/trainable": float(parameter_count(eqx.filter(state.model, is_trainable))),
        "params/optimizer_state_bytes": float(sum(int(x.nbytes) for x in arrays)),
    }


def describe_figures(figures: dict[str, float], lora_rank: int) -> str:
    """One log line of :func:`parameter_figures`, beside what full fine-tuning's Adam would
    hold (two float32 moments a parameter)."""
    total, trainable = figures["params/total"], figures["params/trainable"]
    what = f", LoRA rank {lora_rank}" if lora_rank else ""
    return (
        f"training {trainable:,.0f} of {total:,.0f} parameters ({100 * trainable / total:.2f}%"
        f"{what}); optimizer state {figures['params/optimizer_state_bytes'] / 1e6:,.1f} MB "
        f"(full fine-tuning's Adam: {8 * total / 1e6:,.1f} MB)"
    )
