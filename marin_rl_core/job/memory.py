"""Will the job fit? The memory a job's trainer and samplers need, estimated from the config
before anything starts (issue 61), against what this machine has.

The model's parameters are counted exactly (:mod:`marin_rl_core.job.counts`: the policy with
its LoRA adapters and a loss's own state, such as ppo's critic, built as shapes only; kept in a
cache so that the next start of the same model skips it). From them, per device of the trainer (``d`` devices sharing the parameters, FSDP and
tensor parallel; ``p``/``c`` bytes of the parameter/compute dtype):

* parameters: the trained ones in ``p``, frozen ones (a LoRA base) in ``c``; gradients and
  Adam's two moments of the trained ones in ``p``; the compute-dtype copy of the trained ones
  when ``c != p``; the KL reference (full fine-tuning with ``loss.kl_coef > 0``) in ``c``;
  all over ``d``;
* activations of a micro-batch of ``r`` rows (per device) of ``S`` positions: with gradient
  checkpointing each layer's input (``L r S H c``) plus one layer's working set, else every
  layer's; attention scores ``r heads S S`` in float32 per layer worked on;
* the log-probabilities' logits blocks (two float32 blocks of at most
  :data:`~marin_rl_core.models.LOGITS_BLOCK_BYTES`).

Each rollout worker: the policy in ``model.inference_dtype`` (twice for a LoRA job apart from its
trainer: the base it keeps and the merged copy it samples; for a colocated LoRA job only the
adapters: its sampler samples from the trainer's base), the kv engine's copy of the decoder
layers for a decode round, and the KV cache of a batch (every slot a full sequence). Each
process adds :data:`PROCESS_BYTES` (the runtime and XLA's own).

On CPU, XLA multiplies bfloat16 weights in float32: a train step holds a float32 copy of the
weights it multiplies (``float32 matmuls``: 4 bytes a parameter, measured on Qwen3-1.7B's shape
with 2 and 4 layers: 0.19 GiB more temporaries a layer of 50 M parameters, XLA's
``memory_analysis``) and the LM head transposed in float32 (``head copy``: 1.94 GiB of
temporaries at 151,936 x 2048 in a float32 step, whatever the layer count). The kv engine's
decode round likewise holds its copy of the decoder layers in float32 and the LM head's
(``decode copy``: 0.19 GiB of temporaries a layer and 1.16 GiB for the head, measured the same
way on the same shape: 4 bytes a parameter, where an accelerator copies them in their own
dtype). A colocated
process holds the trainer's and the sampler's parts, but their temporaries (:data:`TEMPORARY`)
one phase at a time on an accelerator: a train step's or a decode round's, the larger. On CPU it
holds both: the memory a phase's temporaries took stays with the process after it (resident
memory stays at a train step's peak after the step), and the trainer's thread and the sampler's
each keep their own (measured on Qwen3-1.7B's shape with LoRA, colocated: one thread running
both phases in turn peaked at the resident parts plus the larger phase, 16.3 GiB; the job, a
thread each, at the resident parts plus both, 20.0 GiB).

Where it runs: on a local job, the sum over the machine's processes against the host memory
available now (CPU), or per GPU against ``nvidia-smi``'s total (one process a GPU). On a
cluster (``ray_address``) nothing is checked. ``resources.check_memory = false`` turns the check
off.
"""

from __future__ import annotations

import math

import attrs

from marin_rl_core.config.schema import RLJobConfig
from marin_rl_core.errors import ConfigError
from marin_rl_core.job.counts import ModelCounts, model_counts

GIB = 2**30
PROCESS_BYTES = int(0.8 * GIB)
"""A job process's own memory besides the model: Python, JAX, levanter and XLA's runtime (a
rollout worker of the tiny default job peaks at ~0.7 GiB resident on CPU)."""


class DoesNotFitError(ConfigError):
    """The job's estimated memory exceeds what the machine has (exit 3, before anything starts)."""


TEMPORARY = frozenset(
    {"activations", "logits", "float32 matmuls", "head copy", "decode copy", "kv cache"}
)
"""Parts held only while a train step or a decode round runs: in a colocated process, where the
two take turns, only the larger of the two phases' counts at once."""


@attrs.frozen
class Estimate:
    """Bytes per device of the trainer and of each rollout worker, by part."""

    trainer: dict[str, int]
    rollout: dict[str, int]
    colocated: bool
    rollout_workers: int
    cpu: bool = False

    @property
    def trainer_bytes(self) -> int:
        return sum(self.trainer.values())

    @property
    def rollout_bytes(self) -> int:
        return sum(self.rollout.values())

    def colocated_bytes(self) -> int:
        """The trainer and the sampler in one process: what both hold, and the larger of a train
        step's and a decode round's temporaries (they take turns); on CPU both (see the module
        docstring)."""
        if self.cpu:
            return self.trainer_bytes + self.rollout_bytes

        def split(parts: dict[str, int]) -> tuple[int, int]:
            temporary = sum(v for k, v in parts.items() if k in TEMPORARY)
            return sum(parts.values()) - temporary, temporary

        (trainer, step), (rollout, decode) = split(self.trainer), split(self.rollout)
        return trainer + rollout + max(step, decode)

    def machine_bytes(self) -> int:
        """What a local job's processes hold together on one host."""
        if self.colocated:
            return self.colocated_bytes()
        return self.trainer_bytes + self.rollout_workers * self.rollout_bytes

    def describe(self) -> str:
        def parts(d: dict[str, int]) -> str:
            return ", ".join(f"{k} {v / GIB:.2f}" for k, v in d.items() if v >= 0.005 * GIB)

        trainer = f"trainer {self.trainer_bytes / GIB:.2f} GiB ({parts(self.trainer)})"
        what = "the same process's sampler" if self.colocated else "each rollout worker"
        return f"{trainer}; {what} {self.rollout_bytes / GIB:.2f} GiB ({parts(self.rollout)})"


def estimate(
    config: RLJobConfig,
    counts: ModelCounts,
    trainer_devices: int = 1,
    limit: int | None = None,
    *,
    cpu: bool = False,
) -> Estimate:
    """The bytes per device of ``config``'s trainer (over ``trainer_devices``) and of each
    rollout worker (see the module docstring); ``limit``: the device's memory, of which the kv
    engine takes at most ``model.inference_memory_fraction`` of what the weights leave; ``cpu``:
    the job runs on the host's CPU (XLA's CPU backend multiplies half-precision weights in
    float32, see the module docstring)."""
    from marin_rl_core.models import LOGITS_BLOCK_BYTES

    t = config.trainer
    p, c = t.dtype_bytes(hf_checkpoint=bool(config.model.checkpoint))
    shards, rows = 1, t.microbatch_size or t.batch_size  # one device, or a host's CPU devices
    if trainer_devices > 1:  # GPUs: per device (a layout that does not fit is told later)
        try:
            sizes = t.mesh.sizes(trainer_devices, t.batch_size, t.microbatch_size)
        except ConfigError:
            sizes = {"fsdp": 1, "tensor_parallel": 1, "batch_shards": 1}
        shards = sizes["fsdp"] * sizes["tensor_parallel"]
        rows = max(1, rows // sizes["batch_shards"])
    seq, n = config.model.max_seq_len, counts
    lora = config.model.lora.enabled
    trainer = {
        "parameters": (n.trainable * p + n.frozen * c) // shards,
        "gradients": n.trainable * p // shards,
        "optimizer": 2 * n.trainable * p // shards,
        "compute copy": (n.trainable * c if c != p else 0) // shards,
        "reference": (n.total * c if n.reference and not lora else 0) // shards,
    }
    layer = rows * seq * (6 * n.hidden + 3 * n.intermediate) * c + rows * n.heads * seq * seq * 4
    kept = n.layers * rows * seq * n.hidden * c if config.model.resolved_gradient_checkpointing \
        else (n.layers - 1) * layer  # fmt: skip
    trainer["activations"] = kept + layer
    trainer["logits"] = min(2 * LOGITS_BLOCK_BYTES, 2 * rows * seq * n.vocab * 4)
    if cpu:  # measured: see the module docstring
        trainer["float32 matmuls"] = 4 * n.total // shards if c < 4 else 0
        trainer["head copy"] = 4 * n.vocab * n.hidden // shards
    trainer["process"] = PROCESS_BYTES
    i = {"float32": 4, "bfloat16": 2}[config.model.resolved_inference_dtype]
    tp = config.model.inference_tensor_parallel
    colocated = config.resources.colocate is True
    slots = max(
        config.sampling_for(lesson).n_prompts * config.sampling_for(lesson).n_generations_per_prompt
        for lesson in config.curriculum.lessons
    ) if config.curriculum.lessons else 1  # fmt: skip
    weights = n.total * i // tp
    if lora and colocated:  # the trainer's base, unmerged: only the adapters are copied
        adapters = n.trainable - n.loss_state
        weights = (adapters * i + (n.frozen * i if i != c else 0)) // tp
    # The kv engine: a copy of the decoder layers for a decode round (on CPU: in float32, and
    # the LM head's too), and as many sequences' caches (and a step's float32 logits) as the
    # batch has, within its share of the memory.
    q, kv = n.heads * n.head_dim, n.kv_heads * n.head_dim
    layers = n.layers * (2 * n.hidden * q + 2 * n.hidden * kv + 3 * n.hidden * n.intermediate)
    copy = layers * i
    if cpu and i < 4:  # measured: see the module docstring
        copy = layers * 4 + 4 * n.vocab * n.hidden
    per_slot = 2 * n.layers * seq * kv * i + seq * 8 + 8 * n.vocab
    cache = slots * per_slot
    if limit is not None:
        cache = min(cache, int(config.model.inference_memory_fraction * max(limit - weights, 0)))
    rollout = {
        "weights": weights,
        "lora base": weights if lora and not colocated else 0,
        "decode copy": copy // tp,
        "kv cache": cache // tp,
        "process": 0 if colocated else PROCESS_BYTES,
    }
    return Estimate(
        trainer=trainer,
        rollout=rollout,
        colocated=colocated,
        rollout_workers=config.num_rollout_workers,
        cpu=cpu,
    )


def available_memory() -> tuple[str, int, int] | None:
    """``(where, bytes, devices)`` a local job can use: each GPU's total memory (``nvidia-smi``)
    and their number, or the host memory available now (one "device": the machine's CPU).
    ``None`` where it cannot be told (a TPU host)."""
    import shutil
    import subprocess

    from marin_rl_core.config.colocation import local_accelerators

    kind, count = local_accelerators()
    if kind == "GPU" and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout  # fmt: skip
            mib = [int(x) for x in out.split() if x.strip().isdigit()]
        except (OSError, subprocess.SubprocessError, ValueError):
            return None
        return (f"each GPU's {min(mib) / 1024:.0f} GiB", min(mib) * 2**20, count) if mib else None
    if kind:
        return None
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: line.split()[1] for line in f}
        free = int(info["MemAvailable"]) * 1024
    except (OSError, KeyError, ValueError):
        import os

        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return f"the {free / GIB:.1f} GiB of memory this machine has free", free, 1


def check_memory(config: RLJobConfig, registry: object) -> str:
    """Stop a local job that cannot fit before anything starts; returns the estimate's line.

    Raises:
        DoesNotFitError: the estimate exceeds the memory available, with each part and the
            settings that would make it fit.
    """
    if config.ray_address or not config.resources.check_memory:
        return ""
    found = available_memory()
    if found is None:
        return ""
    where, limit, devices = found
    counts = model_counts(config, registry)
    gpus = devices if where.startswith("each GPU") else 0
    trainer_devices = max(1, int(config.resources.trainer.num_gpus or 0)) if gpus else 1
    guess = estimate(config, counts, trainer_devices, limit, cpu=not gpus)
    need = guess.colocated_bytes() if gpus and guess.colocated else (
        max(guess.trainer_bytes, guess.rollout_bytes) if gpus else guess.machine_bytes()
    )  # fmt: skip
    line = f"memory: the job needs about {need / GIB:.1f} GiB of {where} ({guess.describe()})"
    if need <= limit:
        return line
    raise DoesNotFitError(
        f"{line}: it does not fit. "
        + "; ".join(_what_would_fit(config, counts, trainer_devices, limit, gpus))
        + ". (resources.check_memory = false starts it anyway.)"
    )


def _what_would_fit(
    config: RLJobConfig, counts: ModelCounts, devices: int, limit: int, gpus: int
) -> list[str]:
    """Settings that would bring the estimate under ``limit``, each with its estimate."""

    def need(c: RLJobConfig, n: ModelCounts) -> int:
        g = estimate(c, n, devices, limit, cpu=not gpus)
        if gpus:
            return g.colocated_bytes() if g.colocated else g.trainer_bytes
        return g.machine_bytes()

    ideas: list[str] = []
    if not config.model.lora.enabled:
        rank = 16
        adapters = _lora_adapters(counts, rank, config.model.lora.targets)
        lora = attrs.evolve(config, model=attrs.evolve(
            config.model, lora=attrs.evolve(config.model.lora, rank=rank)))  # fmt: skip
        n = attrs.evolve(counts, trainable=adapters + counts.loss_state,
                         frozen=counts.total)  # fmt: skip
        settings = [f"model.lora.rank={rank}"]
        colocatable = not gpus and config.num_rollout_workers == 1
        if need(lora, n) > limit and colocatable and config.resources.colocate is not True:
            lora = attrs.evolve(lora, resources=attrs.evolve(lora.resources, colocate=True))
            settings.append("resources.colocate=true")  # one copy of the base
        guess = estimate(lora, n, devices, limit, cpu=not gpus)
        fraction = _fitting_fraction(need(lora, n) - limit, guess, limit)
        if fraction is not None:
            lora = attrs.evolve(
                lora, model=attrs.evolve(lora.model, inference_memory_fraction=fraction)
            )
            settings.append(f"model.inference_memory_fraction={fraction}")
        flags = " ".join(f"--set {x}" for x in settings)
        ideas.append(f"LoRA, {flags}: about {need(lora, n) / GIB:.1f} GiB")
    t = config.trainer
    rows = t.microbatch_size or t.batch_size
    if rows > 1:
        smaller = attrs.evolve(config, trainer=attrs.evolve(t, microbatch_size=max(1, rows // 4)))
        ideas.append(
            f"a smaller micro-batch, --set trainer.microbatch_size={max(1, rows // 4)}: about "
            f"{need(smaller, counts) / GIB:.1f} GiB"
        )
    current = need(config, counts)
    prompts = config.sampling.n_prompts
    # (lessons with sampling of their own are not changed by it: said only where it helps)
    fewer_helps = (
        prompts > 1
        and need(
            attrs.evolve(
                config, sampling=attrs.evolve(config.sampling, n_prompts=prompts // 4 or 1)
            ),
            counts,
        )
        < 0.95 * current
    )
    if fewer_helps:
        fewer = attrs.evolve(
            config, sampling=attrs.evolve(config.sampling, n_prompts=prompts // 4 or 1)
        )
        ideas.append(
            f"fewer sequences sampled at once (the KV cache), --set sampling.n_prompts="
            f"{prompts // 4 or 1}: about {need(fewer, counts) / GIB:.1f} GiB"
        )
    guess = estimate(config, counts, devices, limit, cpu=not gpus)
    fraction = _fitting_fraction(current - limit, guess, limit)
    if fraction is not None:
        smaller = attrs.evolve(
            config, model=attrs.evolve(config.model, inference_memory_fraction=fraction)
        )
        if need(smaller, counts) <= limit:
            ideas.append(
                f"a smaller KV cache (fewer sequences decoded at once), --set "
                f"model.inference_memory_fraction={fraction}: about "
                f"{need(smaller, counts) / GIB:.1f} GiB"
            )
    if config.resources.colocate is not True and not gpus and config.num_rollout_workers == 1:
        one = attrs.evolve(config, resources=attrs.evolve(config.resources, colocate=True))
        ideas.append(
            "the trainer and the sampler in one process (one copy of the model), --set "
            f"resources.colocate=true: about {need(one, counts) / GIB:.1f} GiB"
        )
    if config.resources.colocate is True and gpus:
        ideas.append("colocation off (resources.colocate = false): the sampler on another GPU")
    return ideas or [f"nothing this check knows of brings it under {limit / GIB:.1f} GiB"]


def _fitting_fraction(over: int, guess: Estimate, limit: int) -> float | None:
    """The ``model.inference_memory_fraction`` whose KV cache is ``over`` bytes (and a tenth)
    smaller than ``guess``'s, where the cache is what tips it over; else ``None``. (The kv
    engine's budget is the fraction of what the weights leave of ``limit``, see
    :func:`estimate`: it decodes fewer sequences at once.)"""
    cache, weights = guess.rollout["kv cache"], guess.rollout["weights"]
    if not 0 < over < cache:
        return None
    fraction = math.floor(100 * 0.9 * (cache - over) / max(limit - weights, 1)) / 100
    return fraction if fraction >= 0.01 else None


def _lora_adapters(counts: ModelCounts, rank: int, targets: tuple[str, ...]) -> int:
    """The adapters' parameters at ``rank`` on ``targets`` of a model of ``counts``' shape."""
    h, i, q = counts.hidden, counts.intermediate, counts.heads * counts.head_dim
    kv = counts.kv_heads * counts.head_dim
    shapes = {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        "lm_head": (h, counts.vocab),
    }  # fmt: skip
    per_layer = sum(rank * sum(shapes[t]) for t in targets if t != "lm_head")
    head = rank * sum(shapes["lm_head"]) if "lm_head" in targets else 0
    return counts.layers * per_layer + head
