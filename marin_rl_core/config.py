"""The run configuration: attrs classes, loading from TOML/YAML, overrides and validation.

Resolution order: class defaults < ``--config FILE`` < selection flags (``--env math``) <
``--set path=value``. Plugin sections are flat: ``[loss]`` holds ``name`` plus the fields of
that plugin's config class, so ``--set loss.kl_coef=0.05`` reaches ``RLOOConfig.kl_coef``.

One private cattrs converter, built after the plugins load (:func:`make_converter`), structures
everything; unknown keys are errors and every error names its path (``$.loss.kl_coef``).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import logging
import math
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from marin_rl_core.errors import ConfigError, FieldValueError, one_of
from marin_rl_core.hookspecs import RECORD_TYPES
from marin_rl_core.registry import Registry
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
        inference_engine: how rollout workers sample: ``"paged"`` (levanter's paged-attention
            ``InferenceEngine``: a KV cache, for long generations), ``"dense"`` (one jitted
            forward pass over the whole padded batch per new token: for short answers from short
            sequences, where it is several times faster) or ``"auto"``: dense when the longest
            ``max_tokens`` of any lesson times ``max_seq_len`` is at most 4096, else paged. Both
            report logprobs equal to the trainer's.
        inference_tensor_parallel: how many of a rollout worker's devices its inference engine
            splits the model's attention heads and MLP over (tensor parallelism); 1 keeps the
            model on one device. Must divide the worker's device count (``resources.rollout``).
        gradient_checkpointing: recompute each layer's activations in the backward pass instead
            of keeping them (levanter's scan checkpointing): ``"on"``, ``"off"``, or ``"auto"``:
            on for a Hugging Face checkpoint (real models, whose activations dominate the
            step's memory at real sequence lengths), off for the tiny default model (where
            recomputing costs more than it saves).
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
    inference_engine: str = attrs.field(default="auto", validator=one_of("auto", "paged", "dense"))
    inference_tensor_parallel: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    gradient_checkpointing: str = attrs.field(default="auto", validator=one_of("auto", "on", "off"))

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


@attrs.frozen(kw_only=True)
class MeshConfig:
    """How the learner lays its devices out (levanter's mesh). Devices are split into
    ``data_parallel`` replicas × FSDP × ``tensor_parallel``: each replica holds a full copy of the
    parameters; within one, parameters and optimizer state are sharded (FSDP) over the remaining
    devices along ``fsdp_axis``, and ``tensor_parallel_axes`` are split over ``tensor_parallel``
    devices. The batch is split over replicas × FSDP devices. The default (1, 1) is pure FSDP
    over every device the trainer has (on one device: no sharding at all).

    Args:
        data_parallel: replicas; ``-1``: every device not used for tensor parallelism, i.e. pure
            data parallelism with replicated parameters.
        tensor_parallel: devices each tensor-parallel axis is split over.
        fsdp_axis: the parameter axis sharded by FSDP (levanter's logical axis names).
        tensor_parallel_axes: the parameter axes split by tensor parallelism (levanter's names:
            the MLP's ``mlp``, attention's ``heads`` and ``kv_head``); each must divide by
            ``tensor_parallel``, e.g. a model's key/value heads.
    """

    data_parallel: int = attrs.field(default=1)

    @data_parallel.validator
    def _check_data_parallel(self, attribute: attrs.Attribute, value: int) -> None:
        if value != -1 and value < 1:
            raise ValueError(f"data_parallel must be -1 (all devices) or >= 1, got {value}")

    tensor_parallel: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    fsdp_axis: str = "embed"
    tensor_parallel_axes: tuple[str, ...] = ("mlp", "heads", "kv_head")

    @data_parallel.validator
    def _check_dp(self, attribute: attrs.Attribute, value: int) -> None:
        if value != -1 and value < 1:
            raise FieldValueError(attribute.name, f"must be >= 1 or -1 (all devices), got {value}")


def _check_min_lr_ratio(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise FieldValueError(attribute.name, f"must be in [0, 1], got {value}")


@attrs.frozen(kw_only=True)
class TrainerConfig:
    """The learner: optimizer, batch size, step count, weight sync and checkpoint cadence.

    Args:
        num_train_steps: optimizer steps before the job ends.
        batch_size: rollouts per optimizer step.
        learning_rate: peak Adam learning rate, reached after the warmup.
        warmup_steps: steps of linear warmup.
        lr_schedule: after the warmup, ``"cosine"`` or ``"linear"`` decay to
            ``min_lr_ratio * learning_rate`` at ``num_train_steps``, or ``"constant"``.
        min_lr_ratio: the final learning rate as a fraction of the peak.
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
            batch need not fit in device memory at once. 0: the whole batch at once. The loss is
            the mean of the micro-batches' losses (each a mean over its response tokens).
        mesh: the learner's device mesh (:class:`MeshConfig`).
    """

    num_train_steps: int = attrs.field(default=2000, validator=attrs.validators.ge(1))
    batch_size: int = attrs.field(default=256, validator=attrs.validators.ge(1))
    learning_rate: float = attrs.field(default=1e-3, validator=attrs.validators.ge(0))
    warmup_steps: int = attrs.field(default=5, validator=attrs.validators.ge(0))
    lr_schedule: str = attrs.field(
        default="cosine", validator=one_of("cosine", "linear", "constant")
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
            is short of rollouts. A worker slower than the trainer never waits. 0: no pacing (workers generate as fast as they can; the
            surplus is dropped as stale or feeds dynamic sampling).
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


@attrs.frozen(kw_only=True)
class RoleResources:
    """What one Ray actor of a role asks the cluster for. Ray places it on a node that has them
    and shows it only its own accelerators (``CUDA_VISIBLE_DEVICES``, ``TPU_VISIBLE_CHIPS``).

    Args:
        num_cpus: CPU cores (0: the actor takes no CPU slot, which suits one machine).
        num_gpus: GPUs.
        memory_gb: memory to reserve, in GiB (0: none).
        custom: other resources by name, e.g. ``{TPU = 4}`` or a node label of your cluster.
    """

    num_cpus: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    num_gpus: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    memory_gb: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    custom: Mapping[str, float] = attrs.field(factory=dict)

    def ray_options(self) -> dict[str, Any]:
        """The ``.options(...)`` of an actor that asks for these resources."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory_gb:
            options["memory"] = int(self.memory_gb * 2**30)
        if self.custom:
            options["resources"] = {k: float(v) for k, v in self.custom.items()}
        return options

    def requested(self) -> dict[str, float]:
        """These resources under Ray's names (``CPU``, ``GPU``, ``memory`` in bytes, custom)."""
        out = {"CPU": self.num_cpus, "GPU": self.num_gpus, "memory": self.memory_gb * 2**30}
        out.update({k: float(v) for k, v in self.custom.items()})
        return {k: v for k, v in out.items() if v}


@attrs.frozen(kw_only=True)
class ResourcesConfig:
    """Ray resources per role. A job whose requests the cluster cannot meet stops before any
    actor starts, naming what was asked and what the cluster has.

    Args:
        trainer: the trainer actor's resources (the learner's devices).
        rollout: each rollout worker's resources (its inference engine's devices).
    """

    trainer: RoleResources = RoleResources()
    rollout: RoleResources = RoleResources()


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
            metadata, to ``samples.jsonl`` in the run directory (0: none).
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
class FaultsConfig:
    """How a running job meets faults (docs/faults.md).

    Args:
        stall_timeout_s: the watchdog stops the job (exit code 12, with a final checkpoint) when
            no training step completes for this long, and names the stalled stage and the
            counters that explain it. The first step's wait includes compiling; 0 turns the
            watchdog off.
        worker_restarts: times each rollout worker may be restarted after its process dies
            (Ray restarts the actor; the job goes on). One more death stops the job (exit 13)
            with a final checkpoint.
        restart_backoff_s: wait before handing a restarted worker its work again, doubled at
            each restart of the same worker.
        stop_timeout_s: on Ctrl-C, SIGTERM or a fatal error, how long the trainer gets to write
            its final checkpoint and the workers to stop before the job ends without them.
    """

    stall_timeout_s: float = attrs.field(default=600.0, validator=attrs.validators.ge(0))
    worker_restarts: int = attrs.field(default=3, validator=attrs.validators.ge(0))
    restart_backoff_s: float = attrs.field(default=1.0, validator=attrs.validators.ge(0))
    stop_timeout_s: float = attrs.field(default=120.0, validator=attrs.validators.gt(0))


@attrs.frozen(kw_only=True)
class EpisodesConfig:
    """Limits on each episode the rollout side runs (multi-turn envs; a single-turn env's
    episode is one step). See :mod:`marin_rl_core.episodes`.

    Args:
        max_turns: actions per episode; an episode still going after this many ends truncated
            (and is trained on). The whole episode also shares ``model.max_seq_len`` tokens.
        step_timeout_s: the longest one env call (``reset``, ``step``, a single-turn env's
            ``score``) may take before it is cut off and its episode fails (counted in
            ``rollout/env_timeouts``); 0 means no limit.
        episode_timeout_s: the longest one episode may take, generation included; 0 means no
            limit.
        generation_cohorts: a multi-turn env's episodes are generated in up to this many
            batches per turn, so that one cohort's env steps (a tool call, a sandbox) overlap
            another's generation; 1 generates every waiting episode at once (lock-step turns).
            Single-turn envs always take one generation call.
        env_processes: build each lesson's env in this many processes of its own, so that an
            env that crashes, hangs or burns CPU cannot take the rollout worker down (a dead
            process fails its episodes and is started again; ``rollout/env_process_restarts``).
            0 runs envs in the rollout worker's process.
        env_threads: plain (not ``async``) ``reset`` and ``step`` calls of different episodes
            run on up to this many threads at once, so that one slow or hung call holds up
            only its own episode; 0 (the default) gives each episode of a batch a thread, so
            the timeouts of hung calls all run at once rather than in waves. A call cut off by
            its timeout keeps its thread (Python cannot stop it) until it returns, if ever; the
            runner starts another, and stops using the env (failing its episodes, with a
            message) while :data:`~marin_rl_core.episodes.MAX_HUNG_THREADS` threads are stuck.
            1 makes an env see one call at a time: for envs whose episodes share state that is
            not thread-safe. A single-turn env's ``score`` calls always run one at a time.
    """

    max_turns: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    step_timeout_s: float = attrs.field(default=60.0, validator=attrs.validators.ge(0))
    episode_timeout_s: float = attrs.field(default=600.0, validator=attrs.validators.ge(0))
    generation_cohorts: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    env_processes: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    env_threads: int = attrs.field(default=0, validator=attrs.validators.ge(0))


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


CHOICE_TYPES: dict[str, type[PluginChoice]] = {
    c.kind: c
    for c in (EnvChoice, LossChoice, StorageChoice, WeightTransferChoice, CurriculumChoice)
}


@attrs.frozen(kw_only=True)
class RLJobConfig:
    """Everything a run needs. ``marinrl config show`` prints it resolved, in this shape.

    Args:
        run_id: names the run directory; empty picks ``rl-<timestamp>`` at launch.
        run_dir: parent directory of run directories.
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
    env: EnvChoice = EnvChoice(name="math")
    loss: LossChoice = LossChoice(name="rloo")
    storage: StorageChoice = StorageChoice(name="memory")
    weight_transfer: WeightTransferChoice = WeightTransferChoice(name="arrow_flight")
    curriculum: CurriculumChoice = CurriculumChoice(name="default")

    def sampling_for(self, lesson: LessonConfig) -> SamplingParams:
        """The lesson's own sampling params, else the run's defaults."""
        return lesson.sampling if lesson.sampling is not None else self.sampling

    def eval_sampling_for(self, lesson: LessonConfig) -> SamplingParams:
        """The lesson's own eval sampling params, else the run's ``[eval.sampling]``."""
        return lesson.eval_sampling if lesson.eval_sampling is not None else self.eval.sampling


# --- the converter -------------------------------------------------------------------------------


def _strict_scalar_hooks(converter: cattrs.Converter) -> None:
    """TOML and YAML carry types: ``kl_coef = "0.1"`` is a mistake, not a float."""

    def int_hook(value: Any, _: type) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"expected an integer, got {type(value).__name__} {value!r}")
        return value

    def float_hook(value: Any, _: type) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"expected a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"expected a finite number, got {value!r}")
        return float(value)

    def str_hook(value: Any, _: type) -> str:
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {type(value).__name__} {value!r}")
        return value

    def bool_hook(value: Any, _: type) -> bool:
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {type(value).__name__} {value!r}")
        return value

    converter.register_structure_hook(int, int_hook)
    converter.register_structure_hook(float, float_hook)
    converter.register_structure_hook(str, str_hook)
    converter.register_structure_hook(bool, bool_hook)


def make_converter(registry: Registry) -> cattrs.Converter:
    """The one converter for configs, aware of the loaded plugins' config classes.

    Build it after the registry: plugin sections (``[env]``, ``[loss]`` ...) structure into
    the config class of the plugin their ``name`` selects.
    """
    converter = cattrs.Converter(forbid_extra_keys=True)
    _strict_scalar_hooks(converter)

    def structure_mapping(value: Any, _: type) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a table, got {type(value).__name__}")
        return dict(value)

    converter.register_structure_hook_func(lambda t: t == Mapping[str, Any], structure_mapping)

    for kind, choice_cls in CHOICE_TYPES.items():
        converter.register_structure_hook(
            choice_cls, _choice_structure_hook(converter, registry, kind, choice_cls)
        )
        converter.register_unstructure_hook(choice_cls, _choice_unstructure_hook(converter))
    return converter


def _choice_structure_hook(converter, registry, kind, choice_cls):  # type: ignore[no-untyped-def]
    extra_fields = [f.name for f in attrs.fields(choice_cls) if f.name not in ("name", "config")]

    def hook(value: Any, _: type) -> PluginChoice:
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a table with a 'name' key, got {type(value).__name__}")
        value = dict(value)
        name = value.pop("name", choice_cls.default_name)
        if not isinstance(name, str):
            raise TypeError(f"'name' must be a string, got {type(name).__name__}")
        own = {k: value.pop(k) for k in extra_fields if k in value}
        record = registry.get(kind, name)  # names were checked in _check_plugin_names
        config = converter.structure(value, record.config_class)
        kwargs = {
            k: converter.structure(v, attrs.fields_dict(choice_cls)[k].type) for k, v in own.items()
        }
        return choice_cls(name=name, config=config, **kwargs)

    return hook


def _choice_unstructure_hook(converter):  # type: ignore[no-untyped-def]
    def hook(choice: PluginChoice) -> dict[str, Any]:
        out: dict[str, Any] = {"name": choice.name}
        if choice.config is not None:
            out.update(converter.unstructure(choice.config))
        for f in attrs.fields(type(choice)):
            if f.name not in ("name", "config"):
                out[f.name] = converter.unstructure(getattr(choice, f.name))
        return out

    return hook


# --- errors with paths ---------------------------------------------------------------------------


_FIELD_MARK = "\x00"


def _format_structure_error(exc: Exception, raw: Mapping[str, Any], prefix: str = "$") -> str:
    lines = []
    for message in cattrs.transform_error(exc, path=prefix, format_exception=_format_exception):
        if message.startswith(_FIELD_MARK):  # a FieldValueError: report it at the field's path
            _, field, rest = message.split(_FIELD_MARK, 2)
            text, _, path = rest.rpartition(" @ ")
            message = f"{text} @ {path}.{field}"
        lines.append(f"  {message}")
    return "\n".join(lines)


def _format_exception(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, ForbiddenExtraKeysError):
        known = [f.name for f in attrs.fields(exc.cl)] if attrs.has(exc.cl) else []
        parts = []
        for key in sorted(exc.extra_fields):
            close = difflib.get_close_matches(key, known, n=1)
            parts.append(
                f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
            )
        return "; ".join(parts) + (f"; valid keys: {', '.join(known)}" if known else "")
    if isinstance(exc, KeyError):
        return "required key missing"
    if isinstance(exc, FieldValueError):
        return f"{_FIELD_MARK}{exc.field}{_FIELD_MARK}{exc}"
    type_name = (
        None
        if type_ is None
        else getattr(type_, "__name__", None) or str(type_).replace("typing.", "")
    )
    if isinstance(exc, TypeError | ValueError):
        return f"{exc} (expected {type_name})" if type_name else str(exc)
    return f"{type(exc).__name__}: {exc}"


# --- loading -------------------------------------------------------------------------------------


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a ``.toml``, ``.yaml`` or ``.yml`` file into plain data."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist.")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
            f"offset {exc.start}); save it as UTF-8."
        ) from None
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror}.") from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(
                f"config file {str(path)!r}: unknown format {path.suffix!r}; use .toml or .yaml."
            )
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid: {exc}") from exc
    except Exception as exc:  # yaml.YAMLError without importing yaml at module level
        raise ConfigError(f"config file {str(path)!r} is not valid: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a table at the top level.")
    return data


_PATH_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:\[(\d+)\])?")


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """Parse ``--set a.b[0].c=VALUE``. VALUE is read as a TOML value (``0.05``, ``true``,
    ``"x"``, ``[1, 2]``); anything that is not valid TOML is taken as a plain string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected PATH=VALUE, e.g. --set loss.kl_coef=0.05")
    path_text, value_text = text.split("=", 1)
    path: list[str | int] = []
    for part in path_text.strip().split("."):
        match = _PATH_PART.fullmatch(part)
        if not match:
            raise ConfigError(f"--set {text!r}: {part!r} is not a valid key in the path")
        path.append(match.group(1))
        if match.group(2) is not None:
            path.append(int(match.group(2)))
    try:
        value = tomllib.loads(f"v = {value_text}")["v"]
    except tomllib.TOMLDecodeError:
        value = value_text
    return path, value


def _apply_override(data: dict[str, Any], path: Sequence[str | int], value: Any, text: str) -> None:
    node: Any = data
    for i, key in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(key, int):
            if not isinstance(node, list) or key >= len(node):
                raise ConfigError(f"--set {text!r}: index {key} is out of range")
            node = node[key]
            continue
        if key not in node or node[key] is None:
            node[key] = [] if isinstance(nxt, int) else {}
        node = node[key]
    last = path[-1]
    if isinstance(last, int):
        if not isinstance(node, list) or last >= len(node):
            raise ConfigError(f"--set {text!r}: index {last} is out of range")
    node[last] = value


def _check_plugin_names(data: Mapping[str, Any], registry: Registry) -> None:
    for kind in RECORD_TYPES:
        section = data.get(kind)
        if isinstance(section, Mapping) and "name" in section:
            if isinstance(section["name"], str):
                registry.get(kind, section["name"], where=f"$.{kind}.name")
    lessons = (
        data.get("curriculum", {}).get("lessons", [])
        if isinstance(data.get("curriculum"), Mapping)
        else []
    )
    for i, lesson in enumerate(lessons if isinstance(lessons, list) else []):
        if isinstance(lesson, Mapping) and lesson.get("env"):
            registry.get("env", lesson["env"], where=f"$.curriculum.lessons[{i}].env")


def resolve_config(
    registry: Registry,
    *,
    files: Iterable[str | Path] = (),
    data: Mapping[str, Any] | None = None,
    selections: Mapping[str, str | None] | None = None,
    overrides: Iterable[str] = (),
    notes: list[str] | None = None,
) -> RLJobConfig:
    """Resolve a run's config: defaults < files < ``data`` < selections < ``--set`` overrides.

    A run on a Hugging Face checkpoint that sets no ``model.max_seq_len`` (or sets ``"auto"``)
    gets one derived from its lessons' prompts and ``max_tokens``
    (:func:`~marin_rl_core.rollout_manager.derive_max_seq_len`); the resolved config holds the
    number, so a saved ``config.toml`` keeps it.

    Args:
        registry: the loaded plugins (plugin sections structure into their config classes).
        files: config files, later ones overriding earlier ones key by key.
        data: plain data merged after the files (used by tests and the Python API).
        selections: ``{kind: name}`` from flags like ``--env math``; ``None`` values are skipped.
        overrides: ``PATH=VALUE`` strings from ``--set``.
        notes: when given, sentences about settings derived rather than given are appended
            (the CLI prints them).

    Raises:
        ConfigError: naming the path of every bad key or value.
        UnknownPluginError: for a plugin name nothing registers.
    """
    merged: dict[str, Any] = {}
    for f in files:
        _deep_merge(merged, read_config_file(f))
    if data:
        _deep_merge(merged, json.loads(json.dumps(data)))
    for kind, name in (selections or {}).items():
        if name is not None:
            section = merged.setdefault(kind, {})
            if not isinstance(section, dict):
                raise ConfigError(f"$.{kind}: expected a table, got {type(section).__name__}")
            section["name"] = name
    for text in overrides:
        path, value = parse_override(text)
        _apply_override(merged, path, value, text)
    _check_plugin_names(merged, registry)
    model_section = merged.get("model")
    derive_seq_len = not isinstance(model_section, dict) or "max_seq_len" not in model_section
    if isinstance(model_section, dict) and model_section.get("max_seq_len") == "auto":
        del model_section["max_seq_len"]
        derive_seq_len = True
    converter = make_converter(registry)
    # Partial tables override the defaults key by key: `--set eval.sampling.max_tokens=5` keeps
    # eval's greedy temperature rather than rebuilding SamplingParams from its class defaults.
    # (Plugin sections unstructure to just their name here, so a plugin's keys always start
    # from the defaults of the plugin the section selects.)
    merged = _merged(_drop_none(converter.unstructure(RLJobConfig())), merged)
    try:
        config = converter.structure(merged, RLJobConfig)
    except (ClassValidationError, IterableValidationError) as exc:
        raise ConfigError("invalid config:\n" + _format_structure_error(exc, merged)) from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid config: {exc}") from exc
    config = _fill_plugin_defaults(config, registry, converter)
    validate_config(config, registry, converter)
    if derive_seq_len and config.model.checkpoint:
        from marin_rl_core.rollout_manager import derive_max_seq_len

        value, note = derive_max_seq_len(config, registry)
        config = attrs.evolve(config, model=attrs.evolve(config.model, max_seq_len=value))
        logger.info("%s", note)
        if notes is not None:
            notes.append(note)
    return config


def _merged(base: Mapping[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(base))
    _deep_merge(out, other)
    return out


def _deep_merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def _fill_plugin_defaults(config: RLJobConfig, registry: Registry, converter) -> RLJobConfig:  # type: ignore[no-untyped-def]
    changes: dict[str, Any] = {}
    for kind in CHOICE_TYPES:
        choice = getattr(config, kind)
        if choice.config is None:
            record = registry.get(kind, choice.name)
            choice = attrs.evolve(choice, config=record.config_class())
            changes[kind] = choice
    config = attrs.evolve(config, **changes)
    if not config.curriculum.lessons:
        env_record = registry.get("env", config.env.name)
        if env_record.default_lessons is not None:  # type: ignore[attr-defined]
            lessons = tuple(env_record.default_lessons(config.env.config))  # type: ignore[attr-defined]
        else:
            lessons = (LessonConfig(id=config.env.name),)
        lessons = tuple(
            attrs.evolve(lesson, env=lesson.env or config.env.name) for lesson in lessons
        )
        config = attrs.evolve(config, curriculum=attrs.evolve(config.curriculum, lessons=lessons))
    return config


def lesson_env_config(
    config: RLJobConfig, lesson: LessonConfig, registry: Registry
) -> tuple[str, Any]:
    """The env name and structured env config a lesson uses: the run's ``[env]`` config (when
    the lesson uses the same env) with the lesson's ``env_config`` overrides on top."""
    env_name = lesson.env or config.env.name
    record = registry.get("env", env_name)
    converter = make_converter(registry)
    base = converter.unstructure(config.env.config) if env_name == config.env.name else {}
    base.update(dict(lesson.env_config))
    return env_name, converter.structure(base, record.config_class)


def validate_config(config: RLJobConfig, registry: Registry, converter=None) -> None:  # type: ignore[no-untyped-def]
    """Checks that need more than one field: lesson ids and dependencies (a DAG), lesson env
    configs, batch sizes. Raises :class:`ConfigError` naming the path."""
    converter = converter or make_converter(registry)
    lessons = config.curriculum.lessons
    ids = [lesson.id for lesson in lessons]
    errors: list[str] = []
    for i, lesson in enumerate(lessons):
        path = f"$.curriculum.lessons[{i}]"
        if ids.count(lesson.id) > 1:
            errors.append(f"{path}.id: lesson id {lesson.id!r} is used more than once")
        for j, dep in enumerate(lesson.dependencies):
            if dep.lesson not in ids:
                close = difflib.get_close_matches(dep.lesson, ids, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                errors.append(
                    f"{path}.dependencies[{j}].lesson: no lesson {dep.lesson!r}{hint}; "
                    f"lessons: {', '.join(ids)}"
                )
        env_name = lesson.env or config.env.name
        record = registry.get("env", env_name, where=f"{path}.env")
        base = converter.unstructure(config.env.config) if env_name == config.env.name else {}
        base.update(dict(lesson.env_config))
        try:
            converter.structure(base, record.config_class)
        except (ClassValidationError, IterableValidationError) as exc:
            errors.append(_format_structure_error(exc, base, prefix=f"{path}.env_config").strip())
    cycle = _find_cycle({lesson.id: [d.lesson for d in lesson.dependencies] for lesson in lessons})
    if cycle:
        errors.append(f"$.curriculum.lessons: dependencies form a cycle: {' -> '.join(cycle)}")
    for i, lesson in enumerate(lessons):
        sampling, evaluating = config.sampling_for(lesson), config.eval_sampling_for(lesson)
        if evaluating.max_tokens < sampling.max_tokens:
            own = f"$.curriculum.lessons[{i}].eval_sampling.max_tokens"
            where = own if lesson.eval_sampling else "$.eval.sampling.max_tokens"
            fix = own if lesson.eval_sampling else f"{own} (or {where})"
            errors.append(
                f"{where}: lesson {lesson.id!r} is evaluated with {evaluating.max_tokens} tokens "
                f"but trained with {sampling.max_tokens}, so eval would cut its answers short and "
                f"score them 0; set {fix} to at least {sampling.max_tokens}"
            )
        path = f"$.curriculum.lessons[{i}].sampling" if lesson.sampling else "$.sampling"
        if config.trainer.batch_size % sampling.n_generations_per_prompt:
            errors.append(
                f"$.trainer.batch_size: {config.trainer.batch_size} is not a multiple of "
                f"{path}.n_generations_per_prompt ({sampling.n_generations_per_prompt}), so "
                "training batches would split groups"
            )
    rb, t = config.replay_buffer, config.trainer
    if t.sync_interval_steps > rb.max_rollout_step_delay + 1:
        errors.append(
            f"$.trainer.sync_interval_steps: weights published every {t.sync_interval_steps} steps "
            f"go stale after $.replay_buffer.max_rollout_step_delay + 1 = "
            f"{rb.max_rollout_step_delay + 1} steps, so between publishes the trainer would wait "
            "for rollouts that can never arrive; use sync_interval_steps <= "
            "max_rollout_step_delay + 1"
        )
    if rb.capacity < t.batch_size:
        errors.append(
            f"$.replay_buffer.capacity: {rb.capacity} rollouts can never fill a training batch of "
            f"$.trainer.batch_size = {t.batch_size}; raise the capacity to at least the batch size"
        )
    fractions = dict(rb.env_token_fractions)
    lesson_envs = {lesson.env or config.env.name for lesson in config.curriculum.lessons}
    unknown = sorted(set(fractions) - lesson_envs)
    if unknown:
        errors.append(
            f"$.replay_buffer.env_token_fractions: {', '.join(unknown)} is not the env of any "
            f"lesson (they use {', '.join(sorted(lesson_envs))})"
        )
    if any(not 0 <= f <= 1 for f in fractions.values()) or sum(fractions.values()) > 1 + 1e-6:
        errors.append(
            "$.replay_buffer.env_token_fractions: each share must be in [0, 1] and together at "
            f"most 1, got {fractions}"
        )
    micro = config.trainer.microbatch_size
    if micro and config.trainer.batch_size % micro:
        errors.append(
            f"$.trainer.microbatch_size: {micro} does not divide $.trainer.batch_size "
            f"({config.trainer.batch_size}); pick a divisor such as "
            f"{max(d for d in range(1, micro + 1) if config.trainer.batch_size % d == 0)}"
        )
    if "tensorboard" in config.logging.tracker and importlib.util.find_spec("tensorboardX") is None:
        errors.append(
            '$.logging.tracker: "tensorboard" needs the tensorboardX package, which is not '
            "installed: pip install 'marin-rl[tensorboard]'"
        )
    if config.num_rollout_workers < 1:
        errors.append(f"$.num_rollout_workers: must be >= 1, got {config.num_rollout_workers}")
    for name in (
        "num_train_steps",
        "batch_size",
        "sync_interval_steps",
        "checkpoint_interval_steps",
    ):
        if getattr(config.trainer, name) < 1:
            errors.append(f"$.trainer.{name}: must be >= 1, got {getattr(config.trainer, name)}")
    for tracker in config.logging.tracker:
        if tracker not in ("jsonl", "wandb", "tensorboard"):
            errors.append(
                f"$.logging.tracker: unknown tracker {tracker!r}; choose from jsonl, wandb, tensorboard"
            )
    if errors:
        raise ConfigError("invalid config:\n" + "\n".join(f"  {e}" for e in dict.fromkeys(errors)))


def _find_cycle(graph: Mapping[str, Sequence[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if state.get(nxt) is None and nxt in graph:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in graph:
        if state.get(node) is None:
            found = visit(node)
            if found:
                return found
    return None


# --- printing ------------------------------------------------------------------------------------


def unstructure_config(config: RLJobConfig, registry: Registry) -> dict[str, Any]:
    """Plain data in the shape a ``--config`` file takes (``None`` values left out)."""
    data = make_converter(registry).unstructure(config)
    return _drop_none(data)


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_drop_none(v) for v in value]
    return value


def dump_config(config: RLJobConfig, registry: Registry, *, fmt: str = "toml") -> str:
    """The resolved config as TOML or YAML text that ``--config`` reads back unchanged."""
    data = unstructure_config(config, registry)
    if fmt == "toml":
        import tomli_w

        return tomli_w.dumps(data)
    if fmt in ("yaml", "yml"):
        import yaml

        return yaml.safe_dump(data, sort_keys=False)
    raise ConfigError(f"unknown format {fmt!r}; choose toml or yaml")


__all__ = [
    "CHOICE_TYPES",
    "CurriculumChoice",
    "EnvChoice",
    "EvalConfig",
    "LessonConfig",
    "LessonDependency",
    "EpisodesConfig",
    "FaultsConfig",
    "LoggingConfig",
    "LossChoice",
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
    "dump_config",
    "lesson_env_config",
    "make_converter",
    "read_config_file",
    "resolve_config",
    "unstructure_config",
    "validate_config",
]
