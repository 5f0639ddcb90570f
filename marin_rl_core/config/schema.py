"""The run configuration's schema: one attrs class per section of ``config.toml``.

Plugin sections are flat: ``[loss]`` holds ``name`` plus the fields of that plugin's config
class (:class:`PluginChoice`), so ``--set loss.kl_coef=0.05`` reaches ``RLOOConfig.kl_coef``.
Loading and overrides are in :mod:`marin_rl_core.config.loading`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from marin_rl_core.config.limits import EpisodesConfig, FaultsConfig
from marin_rl_core.config.lora import LoraConfig
from marin_rl_core.config.mesh import MeshConfig
from marin_rl_core.config.resources import ResourcesConfig, RoleResources
from marin_rl_core.config.reward import RewardConfig
from marin_rl_core.errors import FieldValueError, one_of
from marin_rl_core.types import LessonConfig, LessonDependency, SamplingParams

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class ModelConfig:
    """The policy model: the embedded tiny Llama built from scratch, or a Hugging Face checkpoint.

    Args:
        checkpoint: a Hugging Face checkpoint to start from: a local directory (``save_pretrained``
            or ``marinrl export`` output) or a hub id (``Qwen/Qwen3-0.6B``, downloaded into the
            Hugging Face cache; ``marinrl run --model ID`` is the shorthand). Supported: Llama,
            Qwen2/2.5 and Qwen3 (docs/hf-models.md). Empty builds the tiny default
            model from the shape fields below.
        tokenizer: ``"auto"``: the checkpoint's own tokenizer, or the arithmetic tokenizer built
            in code for the default model (numbers 0-99 are single tokens); ``"arithmetic"``; or
            a Hugging Face tokenizer directory or hub id. One whose vocabulary does not fit the
            checkpoint's model is an error unless ``resize_vocab``.
        resize_vocab: resize the checkpoint's vocabulary to the tokenizer's size.
        use_chat_template: render prompts through the tokenizer's chat template when it has one
            (``Problem.messages``, or the prompt as one user message); responses then also end
            at the template's end-of-turn token.
        hidden_dim, intermediate_dim, num_layers, num_heads, num_kv_heads: the default model's
            shape (ignored when ``checkpoint`` is set: the checkpoint's own config wins).
        max_seq_len: the most tokens (prompt + response) a sequence may have; at most a
            checkpoint's ``max_position_embeddings``. Left out (or ``"auto"``) with a
            ``checkpoint``: derived from the lessons' longest prompt (sampled and rendered with
            the chat template, plus a quarter for headroom) plus ``max_tokens`` (times
            ``episodes.max_turns`` for a multi-turn env), rounded up to a multiple of 16;
            ``marinrl run`` prints the value and the saved ``config.toml`` keeps it. 16 for the
            default model.
        inference_dtype: the rollout workers' inference engine dtype: ``"auto"`` (``bfloat16``
            for a Hugging Face checkpoint, ``float32`` for the default model), ``"float32"`` or
            ``"bfloat16"``. Behaviour log-probabilities come from this engine.
        inference_tensor_parallel: how many of a rollout worker's devices its inference engine
            splits the model's attention heads and MLP over (tensor parallelism); 1 keeps the
            model on one device. Must divide the worker's device count (``resources.rollout``).
        inference_memory_fraction: the share of a rollout worker's free device memory (after
            the weights) its generation engine (``[engine]``) may use for caches: the ``kv``
            engine sizes its KV cache slots from it.
        gradient_checkpointing: recompute each layer's activations in the backward pass instead
            of keeping them (levanter's scan checkpointing): ``"on"``, ``"off"``, or ``"auto"``:
            on for a Hugging Face checkpoint (real models, whose activations dominate the
            step's memory at real sequence lengths), off for the tiny default model (where
            recomputing costs more than it saves).
        lora: low-rank adapters instead of full fine-tuning (:class:`LoraConfig`).
    """

    checkpoint: str = ""
    tokenizer: str = "auto"
    resize_vocab: bool = False
    use_chat_template: bool = True
    hidden_dim: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    intermediate_dim: int = attrs.field(default=256, validator=attrs.validators.ge(1))
    num_layers: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    num_heads: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    num_kv_heads: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    max_seq_len: int = attrs.field(default=16, validator=attrs.validators.ge(2))
    inference_dtype: str = attrs.field(
        default="auto", validator=one_of("auto", "float32", "bfloat16")
    )
    inference_tensor_parallel: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    inference_memory_fraction: float = attrs.field(
        default=0.5, validator=[attrs.validators.gt(0), attrs.validators.le(1)]
    )
    gradient_checkpointing: str = attrs.field(default="auto", validator=one_of("auto", "on", "off"))
    lora: LoraConfig = LoraConfig()

    @property
    def resolved_gradient_checkpointing(self) -> bool:
        if self.gradient_checkpointing != "auto":
            return self.gradient_checkpointing == "on"
        return bool(self.checkpoint)

    @property
    def resolved_inference_dtype(self) -> str:
        if self.inference_dtype != "auto":
            return self.inference_dtype
        return "bfloat16" if self.checkpoint else "float32"


PRECISIONS = {"f32": "f32", "bf16": "p=f32,c=bfloat16", "bf16-params": "bfloat16"}


def _check_precision(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if value == "auto" or value in PRECISIONS:
        return
    import jmp

    try:
        jmp.get_policy(value)
    except ValueError as exc:
        raise FieldValueError(
            attribute.name,
            f"{value!r} is not a precision: use auto, {', '.join(PRECISIONS)} or a jmp policy "
            f"such as 'p=f32,c=bfloat16' ({exc})",
        ) from None


def _check_min_lr_ratio(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise FieldValueError(attribute.name, f"must be in [0, 1], got {value}")


@attrs.frozen(kw_only=True)
class TrainerConfig:
    """The learner: optimizer, batch size, step count, weight sync and checkpoint cadence.

    Args:
        num_train_steps: trainer steps before the job ends (one optimizer update each,
            unless the loss makes several per batch: ``ppo``'s ``epochs`` x ``minibatches``).
        batch_size: rollouts per trainer step.
        learning_rate: peak Adam learning rate, reached after the warmup.
        warmup_steps: steps of linear warmup.
        lr_schedule: after the warmup, ``"constant"`` (the peak to the end: the default, as
            in most RL post-training, and what lets a late curriculum lesson still learn),
            or ``"cosine"`` or ``"linear"`` decay to ``min_lr_ratio * learning_rate`` at
            ``num_train_steps``.
        min_lr_ratio: the final learning rate of a decaying schedule, as a fraction of the peak.
        weight_decay: AdamW weight decay.
        adam_eps: AdamW's epsilon (added to the root of the second moment).
        max_grad_norm: global gradient-norm clip; 0 disables it.
        sync_interval_steps: publish weights to rollout workers every this many steps.
        checkpoint_interval_steps: save a checkpoint every this many steps (and at the end).
        precision: the mixed-precision policy: ``"auto"`` (``bf16`` for a Hugging Face
            checkpoint, ``f32`` for the default model), ``"f32"``, ``"bf16"`` (float32
            parameters and optimizer state, bfloat16 compute), ``"bf16-params"`` (bfloat16
            everywhere) or any ``jmp`` policy string.
        pack_rollouts: pack several rollouts into one row of ``model.max_seq_len`` tokens where
            they fit (segment ids keep them apart), so short rollouts waste fewer padded
            positions; the batch then has as many rows as packing needs, rounded up to an
            eighth of ``batch_size`` (``bench/packing.py`` prints the padding saved).
        trim_rows: pad a batch's rows only to its longest row, rounded up to a power of two
            (at least 8, at most ``model.max_seq_len``), not to ``model.max_seq_len``: short
            rollouts cost what their tokens cost, and at most a handful of shapes compile.
            Off: every row has ``model.max_seq_len`` positions (one shape).
        microbatch_size: rollouts per forward/backward pass; the gradients of
            ``batch_size / microbatch_size`` micro-batches are accumulated into one step, so a
            batch need not fit in device memory at once. 0: the whole batch at once. The loss
            and gradients do not depend on it (the loss's weights span the whole step).
        mesh: the learner's device mesh (:class:`MeshConfig`).
    """

    num_train_steps: int = attrs.field(default=2000, validator=attrs.validators.ge(1))
    batch_size: int = attrs.field(default=256, validator=attrs.validators.ge(1))
    learning_rate: float = attrs.field(default=1e-3, validator=attrs.validators.ge(0))
    warmup_steps: int = attrs.field(default=5, validator=attrs.validators.ge(0))
    lr_schedule: str = attrs.field(
        default="constant", validator=one_of("cosine", "linear", "constant")
    )
    min_lr_ratio: float = attrs.field(default=0.1, validator=_check_min_lr_ratio)
    weight_decay: float = attrs.field(default=0.5, validator=attrs.validators.ge(0))
    adam_eps: float = attrs.field(default=1e-8, validator=attrs.validators.gt(0.0))
    max_grad_norm: float = attrs.field(default=1.0, validator=attrs.validators.ge(0))
    sync_interval_steps: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    checkpoint_interval_steps: int = attrs.field(default=250, validator=attrs.validators.ge(1))
    precision: str = attrs.field(default="auto", validator=_check_precision)
    pack_rollouts: bool = False
    trim_rows: bool = True
    microbatch_size: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    mesh: MeshConfig = MeshConfig()

    def mp_policy(self, *, hf_checkpoint: bool) -> Any:
        """The ``jmp.Policy`` of :attr:`precision`."""
        import jmp

        name = self.precision
        if name == "auto":
            name = "bf16" if hf_checkpoint else "f32"
        return jmp.get_policy(PRECISIONS.get(name, name))

    def dtype_bytes(self, *, hf_checkpoint: bool) -> tuple[int, int]:
        """Bytes of a parameter and of a computed value under :attr:`precision`: the named
        precisions without importing JAX (the memory check runs before anything starts)."""
        name = self.precision
        if name == "auto":
            name = "bf16" if hf_checkpoint else "f32"
        named = {"f32": (4, 4), "bf16": (4, 2), "bf16-params": (2, 2)}  # PRECISIONS' policies
        if name in named:
            return named[name]
        import numpy as np

        mp = self.mp_policy(hf_checkpoint=hf_checkpoint)
        return np.dtype(mp.param_dtype).itemsize, np.dtype(mp.compute_dtype).itemsize


@attrs.frozen(kw_only=True)
class ReplayBufferConfig:
    """The trainer's pool of rollouts waiting to be trained on.

    Args:
        capacity: the most rollouts held; the oldest are evicted first.
        max_rollout_step_delay: drop rollouts sampled with weights more than this many steps
            behind the trainer.
        max_rollout_timestamp_delay: drop rollouts older than this many seconds.
        recency_alpha: sampling weight grows as ``(1 + rank_from_oldest) ** alpha``; 0 samples
            uniformly.
        max_samples_per_rollout: how many training batches may use one rollout.
        uninformative_group_weight: sampling weight multiplier of a group whose advantages are
            all zero (every sample got the same reward, so it carries no policy gradient); 0
            fills a batch with such groups only when informative ones run out (dynamic
            sampling, as in DAPO). 1 treats all groups alike.
        min_group_size: a group with fewer rollouts left (after staleness and reuse) is not
            sampled; group-relative advantages from one or two samples are noise.
        max_generated_per_trained: paces the rollout workers: together they generate at most
            this many rollouts per rollout a training step uses, and may run at most
            ``max_rollout_step_delay`` steps ahead of the newest weights they have (further
            ahead, what they made would be stale on arrival); a worker that is that far ahead
            waits for newer weights (``rollout/paced_seconds``), or until the trainer says it
            is short of rollouts. Rollouts the trainer dropped unused (stale, evicted) are
            generated again. A worker slower than the trainer never waits. 0: no pacing
            (workers generate as fast as they can; the surplus is dropped as stale or feeds
            dynamic sampling).
        env_token_fractions: each env's share of a training batch's tokens, when rollouts of
            several envs wait (``{math = 0.7, guess = 0.3}``); envs not named share what is
            left. Batches are filled round robin by token deficit: the env furthest below its
            share gives its next group (newest and informative first). Empty: every group
            competes alike, whatever its env.
    """

    capacity: int = attrs.field(default=4096, validator=attrs.validators.ge(1))
    max_rollout_step_delay: int = attrs.field(default=1, validator=attrs.validators.ge(0))
    max_rollout_timestamp_delay: float = 3600.0
    recency_alpha: float = attrs.field(default=3.0, validator=attrs.validators.ge(0))
    max_samples_per_rollout: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    uninformative_group_weight: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    min_group_size: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    max_generated_per_trained: float = attrs.field(default=1.0, validator=attrs.validators.ge(0))
    env_token_fractions: Mapping[str, float] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class EvalConfig:
    """Held-out evaluation run by the rollout workers.

    Args:
        frequency: full eval of every lesson every this many trainer steps (0: only at start
            and end), by rollout worker 0 with the newest weights it has.
        n_examples: problems per lesson in a full eval.
        micro_frequency: a small eval of the current lesson every this many batches (0: off).
        micro_n_examples: problems in a micro-eval.
        sampling: sampling for eval (greedy by default).
    """

    frequency: int = attrs.field(default=25, validator=attrs.validators.ge(0))
    n_examples: int = attrs.field(default=30, validator=attrs.validators.ge(1))
    micro_frequency: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    micro_n_examples: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    sampling: SamplingParams = SamplingParams(
        temperature=0.0, max_tokens=3, n_generations_per_prompt=1
    )


TRACKERS = ("jsonl", "wandb", "tensorboard")


@attrs.frozen(kw_only=True)
class LoggingConfig:
    """What the user sees.

    Args:
        progress: show a progress bar of training steps.
        tracker: ``"jsonl"`` (always written to the run directory), plus ``"wandb"`` and/or
            ``"tensorboard"`` through levanter's trackers. wandb reads ``WANDB_PROJECT``
            (default ``marinrl``), ``WANDB_ENTITY`` and ``WANDB_MODE`` from the environment and
            keeps its local files under the run directory; tensorboard writes
            ``RUN_DIR/tensorboard/RUN_ID`` and needs ``pip install 'marin-rl[tensorboard]'``.
        log_every: log metrics every this many steps.
        samples_per_step: rollouts of each training batch written, decoded and with their
            metadata, to ``samples.jsonl`` in the run directory, and of each lesson at each
            eval to ``eval_samples.jsonl`` (0: none; ``marinrl samples`` shows them).
    """

    progress: bool = True
    tracker: tuple[str, ...] = attrs.field(
        default=("jsonl",),
        converter=tuple,
        validator=attrs.validators.deep_iterable(one_of(*TRACKERS)),
    )
    log_every: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    samples_per_step: int = attrs.field(default=2, validator=attrs.validators.ge(0))


@attrs.frozen(kw_only=True)
class PluginChoice:
    """A chosen plugin and its config; in files the ``name`` sits beside the config's keys."""

    kind: ClassVar[str] = ""
    default_name: ClassVar[str] = ""

    name: str
    config: Any = None


@attrs.frozen(kw_only=True)
class EnvChoice(PluginChoice):
    kind: ClassVar[str] = "env"
    default_name: ClassVar[str] = "math"


@attrs.frozen(kw_only=True)
class LossChoice(PluginChoice):
    kind: ClassVar[str] = "loss"
    default_name: ClassVar[str] = "rloo"


@attrs.frozen(kw_only=True)
class StorageChoice(PluginChoice):
    kind: ClassVar[str] = "storage"
    default_name: ClassVar[str] = "memory"


@attrs.frozen(kw_only=True)
class WeightTransferChoice(PluginChoice):
    kind: ClassVar[str] = "weight_transfer"
    default_name: ClassVar[str] = "arrow_flight"


@attrs.frozen(kw_only=True)
class CurriculumChoice(PluginChoice):
    """The curriculum policy plus the lessons it schedules.

    ``lessons`` empty means: the lessons the env plugin suggests (its ``default_lessons``), or a
    single lesson with the run's env config.
    """

    kind: ClassVar[str] = "curriculum"
    default_name: ClassVar[str] = "default"
    lessons: tuple[LessonConfig, ...] = attrs.field(default=(), converter=tuple)


@attrs.frozen(kw_only=True)
class EngineChoice(PluginChoice):
    """The generation engine rollout workers sample with; ``auto`` picks the fastest measured
    for the workers' platform and model."""

    kind: ClassVar[str] = "engine"
    default_name: ClassVar[str] = "auto"


CHOICE_TYPES: dict[str, type[PluginChoice]] = {
    c.kind: c
    for c in (
        EnvChoice,
        LossChoice,
        StorageChoice,
        WeightTransferChoice,
        CurriculumChoice,
        EngineChoice,
    )
}


@attrs.frozen(kw_only=True)
class RLJobConfig:
    """Everything a run needs. ``marinrl config show`` prints it resolved, in this shape.

    Args:
        run_id: names the run directory; empty picks ``rl-<timestamp>`` at launch.
        run_dir: parent directory of run directories: a path, or a bucket URL
            (``gs://bucket/runs``; see :mod:`marin_rl_core.rundir`).
        seed: seeds model init, problem sampling and generation.
        num_rollout_workers: rollout worker actors.
        ray_address: a running Ray cluster to use; empty starts a local one.
        sampling: default sampling for training rollouts (lessons may override).
        compilation_cache: where the trainer and rollout workers keep JAX's persistent
            compilation cache, so that a second run starts without compiling again: a directory,
            ``"auto"`` (``$JAX_COMPILATION_CACHE_DIR`` if set, else
            ``$XDG_CACHE_HOME/marinrl/jax``, by default ``~/.cache/marinrl/jax``) or ``""``
            (off). Functions with host callbacks (levanter's paged inference engine) are not
            cached; everything else is.
    """

    run_id: str = ""
    run_dir: str = "runs"
    seed: int = 0
    num_rollout_workers: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    ray_address: str = ""
    compilation_cache: str = "auto"
    model: ModelConfig = ModelConfig()
    resources: ResourcesConfig = ResourcesConfig()
    trainer: TrainerConfig = TrainerConfig()
    replay_buffer: ReplayBufferConfig = ReplayBufferConfig()
    # The default task's answers are one token plus the stop token: see docs/default-task.md.
    sampling: SamplingParams = SamplingParams(temperature=1.5, max_tokens=2)
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    faults: FaultsConfig = FaultsConfig()
    episodes: EpisodesConfig = EpisodesConfig()
    reward: RewardConfig = RewardConfig()
    env: EnvChoice = EnvChoice(name="math")
    loss: LossChoice = LossChoice(name="rloo")
    storage: StorageChoice = StorageChoice(name="memory")
    weight_transfer: WeightTransferChoice = WeightTransferChoice(name="arrow_flight")
    curriculum: CurriculumChoice = CurriculumChoice(name="default")
    engine: EngineChoice = EngineChoice(name="auto")

    def sampling_for(self, lesson: LessonConfig) -> SamplingParams:
        """The lesson's own sampling params, else the run's defaults."""
        return lesson.sampling if lesson.sampling is not None else self.sampling

    def eval_sampling_for(self, lesson: LessonConfig) -> SamplingParams:
        """The lesson's own eval sampling params, else the run's ``[eval.sampling]``."""
        return lesson.eval_sampling if lesson.eval_sampling is not None else self.eval.sampling


__all__ = [
    "CHOICE_TYPES",
    "CurriculumChoice",
    "EngineChoice",
    "EnvChoice",
    "EvalConfig",
    "LessonConfig",
    "LessonDependency",
    "EpisodesConfig",
    "FaultsConfig",
    "LoggingConfig",
    "LoraConfig",
    "LossChoice",
    "MeshConfig",
    "ModelConfig",
    "PluginChoice",
    "RLJobConfig",
    "ReplayBufferConfig",
    "ResourcesConfig",
    "RoleResources",
    "SamplingParams",
    "StorageChoice",
    "TrainerConfig",
    "WeightTransferChoice",
]
