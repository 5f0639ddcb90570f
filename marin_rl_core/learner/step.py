"""The train step on levanter's trainer machinery: :class:`Learner` holds the device mesh, the
sharded parameters and optimizer state (AdamW from :func:`make_optimizer`), mixed precision and
gradient accumulation, and runs the loss plugin's loss as levanter's own step, with the frozen
models a loss needs passed in as sharded arguments (never compiled in as constants). How that
step is compiled and its metrics captured is :mod:`~marin_rl_core.learner.levanter_step`'s."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from marin_rl_core.config.schema import TrainerConfig
from marin_rl_core.learner.levanter_step import CaptureTracker, levanter_trainer, train_only
from marin_rl_core.learner.optimizer import make_optimizer


def all_finite(tree: Any) -> bool:
    """Whether every floating-point array of ``tree`` is free of NaN and infinity."""
    import equinox as eqx

    _compile_finite()
    return bool(_finite_jit(eqx.filter(tree, eqx.is_inexact_array)))


def _finite(tree: Any) -> Any:
    import jax
    import jax.numpy as jnp

    leaves = jax.tree.leaves(tree)
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves])) if leaves else True


_finite_jit: Any = None


def _compile_finite() -> None:
    global _finite_jit
    if _finite_jit is None:
        import jax

        _finite_jit = jax.jit(_finite)


def _metric(name: str, value: Any) -> Any:
    """A loss metric as a levanter ``Metric``, reduced over micro-batches by its name: summed for
    ``num_*``/``total_*``/``*_count``/``*_total``/``*_sum``, max/min for ``*_max``/``*_min``,
    averaged otherwise (levanter's rules, without its message for every other name)."""
    from levanter.metrics import Metric, ReductionType

    if isinstance(value, Metric):
        return value
    return Metric.from_value(value, getattr(ReductionType, metric_reduction(name).upper()))


def metric_reduction(name: str) -> str:
    """How a metric named ``name`` combines over micro-batches or updates: ``"sum"`` for
    ``num_*``/``total_*``/``*_count``/``*_total``/``*_sum``, ``"max"``/``"min"`` for
    ``*_max``/``max_*`` and ``*_min``/``min_*``, ``"mean"`` otherwise."""
    lower = name.lower()
    if lower.startswith(("num_", "total_")) or lower.endswith(("_count", "_total", "_sum")):
        return "sum"
    if lower.endswith("_max") or lower.startswith("max_"):
        return "max"
    if lower.endswith("_min") or lower.startswith("min_"):
        return "min"
    return "mean"


def _with_metrics(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``loss_fn(model, batch, ...)`` returning ``(loss, metrics)`` with levanter ``Metric``s;
    a :class:`~marin_rl_core.learner.loss.TokenLoss` is weighed over the step first."""
    from marin_rl_core.learner.loss import TokenLoss, aggregate

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = loss_fn(*args, **kwargs)
        loss, metrics = aggregate(out, args[1]) if isinstance(out, TokenLoss) else out
        return loss, {k: _metric(k, v) for k, v in metrics.items()}

    return wrapped


def plugin_loss_fn(
    module: Any, reference_of: Callable[[Any], Any] | None = None
) -> Callable[..., Any]:
    """A loss plugin's loss function, made inside the traced step from the reference model the
    step receives as an argument (:meth:`Learner.set_loss`), so that nothing it closes over is a
    frozen model. ``create_loss_fn`` is cheap and pure (the protocol says so); the structure it
    is given as ``train_model`` is the policy being trained (with the loss's own state, when it
    has some). :meth:`Learner.set_loss` weighs a returned
    :class:`~marin_rl_core.learner.loss.TokenLoss` into the step's loss.

    ``reference_of``: the reference model made from the model being trained instead (a LoRA
    policy's base: :func:`~marin_rl_core.models.lora.without_adapters`), with no frozen copy."""

    from marin_rl_core.learner.loss import checked_token_loss

    def loss_fn(model: Any, batch: Any, *, key: Any = None, reference: Any = None) -> Any:
        if reference_of is not None:
            reference = reference_of(model)
        return checked_token_loss(module.create_loss_fn(reference, model)(model, batch, key=key))

    return loss_fn


def plugin_prepare_fn(
    plan: Any, reference_of: Callable[[Any], Any] | None = None
) -> Callable[..., Any] | None:
    """A loss's whole-step preparation (its :class:`~marin_rl_core.protocols.LossPlan`'s
    ``create_prepare_fn``; ``None``: none), made inside the traced function from the reference
    model it receives, as :func:`plugin_loss_fn`: ``fn(model, batches, *, reference=None)``
    returning one dict of per-token arrays per minibatch (:meth:`Learner.prepare`)."""
    create = plan.create_prepare_fn
    if create is None:
        return None

    def prepare(model: Any, batches: Any, *, reference: Any = None) -> Any:
        if reference_of is not None:
            reference = reference_of(model)
        return create(reference, model)(model, batches)

    return prepare


class Learner:
    """levanter's :class:`levanter.trainer.Trainer`, set up from marinrl's ``[trainer]`` config and
    stepped one batch at a time (the RL loop, not levanter's data loader, decides when).

    It brings levanter's device mesh and axis mappings (``trainer.mesh``: replicas x FSDP x
    tensor parallel over every device this process sees), sharded parameters and optimizer state
    (``TrainerState``), the mixed-precision policy (``trainer.precision``), gradient accumulation
    over micro-batches (``trainer.microbatch_size``) and levanter's gradient-norm watch.

    The mesh exists from construction (:meth:`shard` places a reference model on it); the loss
    comes after (:meth:`set_loss`), since a KL loss is built from that sharded reference.

    Args:
        config: the ``[trainer]`` section.
        hf_checkpoint: whether the model comes from a Hugging Face checkpoint (``precision =
            "auto"`` is then bf16 compute).
        run_id: levanter's run id (names nothing on disk here).
    """

    def __init__(
        self, config: TrainerConfig, *, hf_checkpoint: bool = False, run_id: str = "marinrl"
    ):
        import haliax as hax
        import jax
        import levanter.trainer

        from marin_rl_core.models.packing import BATCH

        sizes = config.mesh.sizes(jax.device_count(), config.batch_size, config.microbatch_size)
        self.sizes = sizes
        self.tracker = CaptureTracker()
        micro = config.microbatch_size
        self.levanter_config = levanter.trainer.TrainerConfig(
            mp=config.mp_policy(hf_checkpoint=hf_checkpoint),
            tracker=self.tracker,  # type: ignore[arg-type]
            id=run_id,
            batch_axis=BATCH,
            fsdp_axis=config.mesh.fsdp_axis,
            tensor_parallel_axes=list(config.mesh.tensor_parallel_axes),
            replica_ici_axis_size=sizes["data_parallel"],
            model_axis_size=sizes["tensor_parallel"],
            train_batch_size=config.batch_size,
            per_device_parallelism=(micro or config.batch_size) // sizes["batch_shards"],
            num_train_steps=config.num_train_steps,
            crash_on_nan=False,
            crash_on_inf=False,
            log_jaxprs=False,
            log_xla_hlo=False,
            require_accelerator=False,
        )
        self.mesh = self.levanter_config.device_mesh
        self.parameter_axis_mapping = self.levanter_config.parameter_axis_mapping
        # FSDP splits the parameters, the LM head among them, over devices: log-probabilities
        # are then computed vocabulary-parallel (model.next_token_logprobs_and_entropy).
        with hax.partitioning.set_mesh(self.mesh):
            self._lm_head_split = any(
                (hax.partitioning.physical_axis_size(name, self.parameter_axis_mapping) or 1) > 1
                for name in ("embed", "vocab")
            )
        self.compute_axis_mapping = self.levanter_config.compute_axis_mapping
        self.config = config
        self.optimizer = make_optimizer(config)
        self.trainer: Any = None
        self.is_trainable: Any = True
        self._frozen: dict[str, Any] = {}
        self._prepare: Any = None
        from marin_rl_core.protocols import LossPlan

        self.plan = LossPlan()

    def set_loss(
        self,
        loss_fn: Callable[..., Any],
        *,
        reference: Any = None,
        state_learning_rate: float | None = None,
        prepare_fn: Callable[..., Any] | None = None,
        plan: Any = None,
        is_trainable: Any = True,
    ) -> None:
        """Train ``loss_fn(model, batch, *, key)`` from now on: it returns a
        :class:`~marin_rl_core.learner.loss.TokenLoss`, or ``(loss, metrics)`` taken as given
        (the learner's own API, for benchmarks' plain losses; a loss plugin's function comes
        through :func:`plugin_loss_fn`, which takes a ``TokenLoss`` only).

        With a ``reference`` (a frozen model placed by :meth:`shard`), every step calls
        ``loss_fn(model, batch, *, key, reference=reference)``: the reference enters the compiled
        step as a sharded argument. A loss function that closed over it instead would compile
        all of its weights into the step as constants (gigabytes for a real model, in every
        compiled shape and in the compile cache's key, beside the sharded copy).

        ``state_learning_rate``: the model trained will be a
        :class:`~marin_rl_core.learner.loss.TrainedModel` whose loss state learns at this rate
        (:func:`make_optimizer`).

        ``prepare_fn``: the loss's preparation (:func:`plugin_prepare_fn`), run by
        :meth:`prepare`. ``plan``: the loss's
        :class:`~marin_rl_core.protocols.LossPlan` (updates per trainer step and frozen
        policy steps, for the learning-rate schedule).

        ``is_trainable``: levanter's filter tree of the parameters trained (``True``: all; a
        LoRA policy's :func:`~marin_rl_core.models.lora.trainable_filter`). The others are
        frozen: held in the compute dtype, with no optimizer state, no gradients computed
        (:func:`~marin_rl_core.learner.levanter_step.train_only`) and no share of the
        gradient norm."""
        import equinox as eqx
        from levanter.callbacks.watch import WatchCallback
        from levanter.utils.tree_utils import inference_mode

        from marin_rl_core.protocols import LossPlan

        self._frozen = {} if reference is None else {"reference": reference}
        self.plan = plan or LossPlan()
        if (
            state_learning_rate is not None
            or self.plan.updates_per_step > 1
            or self.plan.frozen_policy_steps > 0
        ):
            self.optimizer = make_optimizer(
                self.config,
                state_learning_rate=state_learning_rate,
                updates_per_step=self.plan.updates_per_step,
                frozen_policy_updates=self.plan.frozen_policy_steps * self.plan.updates_per_step,
            )
        self._prepare = None
        if prepare_fn is not None:
            mp, mapping = self.mp, self.compute_axis_mapping

            def prepare(model: Any, batches: Any, frozen: dict[str, Any]) -> Any:
                import haliax as hax

                with hax.axis_mapping(mapping):
                    model = mp.cast_to_compute(inference_mode(model, True))
                    return prepare_fn(model, batches, **frozen)

            self._prepare = eqx.filter_jit(prepare)
        self.is_trainable = is_trainable
        self.trainer = levanter_trainer(
            self.levanter_config, self.optimizer, _with_metrics(loss_fn), add_default_hooks=False
        )
        if is_trainable is not True:
            train_only(self.trainer, is_trainable)
        # The global gradient norm (before clipping), as levanter's watch computes it.
        self.trainer.add_hook(
            WatchCallback(
                watch_targets=["grads"], include_norms=True, include_per_parameter_norms=False
            ),
            every=1,
        )

    def _trainer(self) -> Any:
        if self.trainer is None:
            raise RuntimeError("Learner.set_loss must be called before the first step")
        return self.trainer

    @property
    def mp(self) -> Any:
        return self.levanter_config.mp

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        import haliax as hax
        import levanter

        from marin_rl_core.models.logprobs import lm_head_split

        with (
            levanter.current_tracker(self.tracker),  # type: ignore[arg-type]
            hax.partitioning.set_mesh(self.mesh),
            hax.axis_mapping(self.parameter_axis_mapping),
            lm_head_split(self._lm_head_split),
            warnings.catch_warnings(),
        ):
            # Donation is best effort: XLA keeps a buffer it cannot alias, and says so each time.
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            yield

    def shard(self, tree: Any) -> Any:
        """``tree`` placed on the mesh with the parameter sharding (e.g. a reference model)."""
        import haliax as hax

        with self._context():
            return hax.shard(tree, self.parameter_axis_mapping)

    def init_state(self, model: Any, *, key: Any) -> Any:
        """A fresh, sharded ``TrainerState`` (step 0) of ``model``."""
        with self._context():
            return self._trainer().initial_state(key, model=model, is_trainable=self.is_trainable)

    def state_shapes(self, model: Any, *, key: Any) -> Any:
        """The shapes and dtypes of :meth:`init_state`'s state, computed without making it (what
        :meth:`restore` needs to read a checkpoint into)."""
        import equinox as eqx

        trainer = self._trainer()
        with self._context():
            return eqx.filter_eval_shape(
                lambda m, k: trainer.initial_state(k, model=m, is_trainable=self.is_trainable),
                model,
                key,
            )

    def restore(
        self, checkpoint: str | Path, like: Any, *, subpath: str | None = None, only: Any = None
    ) -> Any:
        """``like`` (a ``TrainerState``, or its part at ``subpath``) with a checkpoint's values,
        sharded over this mesh. With ``only`` (a filter of ``like``: an adapters-only checkpoint
        of a LoRA run), that part is read and the rest keeps ``like``'s values (the base)."""
        import equinox as eqx

        from marin_rl_core.learner.checkpoint import load_trainer_state

        if only is not None:
            read, kept = eqx.partition(like, only)
            return eqx.combine(self.restore(checkpoint, read, subpath=subpath), kept)

        # levanter notes every empty slot of the state (no model averaging: None) as an
        # "Unknown leaf type": checkpoint.py's filter drops those lines.
        with self._context():
            return load_trainer_state(
                checkpoint,
                like,
                axis_mapping=self.parameter_axis_mapping,
                mesh=self.mesh,
                subpath=subpath,
            )

    def with_step(self, state: Any, step: Any) -> Any:
        """``state`` at optimizer update ``step``: its step and every counter of its optimizer
        state (Adam's bias correction, the learning-rate schedule) set to it, for a fresh
        optimizer state that goes on from a checkpoint's step."""
        import equinox as eqx
        import jax
        import jax.numpy as jnp

        step = int(step)

        def at_step(x: Any) -> Any:
            # A new buffer for each (with x's sharding): the step donates every one of them.
            if eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.integer) and x.ndim == 0:
                return jnp.zeros_like(x) + step
            return x

        with self._context():
            return eqx.tree_at(
                lambda s: (s.step, s.opt_state),
                state,
                (at_step(state.step), jax.tree.map(at_step, state.opt_state)),
            )

    def peak_memory_bytes(self, state: Any, batch: Any) -> int:
        """XLA's peak memory estimate of one compiled step on ``(state, batch)``: temporaries,
        arguments and outputs, per device (for ``bench/step_time.py``)."""
        with self._context():
            stats = self._lower(state, batch).compile().memory_analysis()
        return int(
            stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes
        )

    def constant_bytes(self, state: Any, batch: Any) -> list[int]:
        """The size in bytes of every constant in the lowered step on ``(state, batch)``,
        largest first. Frozen models enter the step as arguments, so these stay small
        (scalars, iotas); a model closed over by the loss would show up here whole."""
        import re

        with self._context():
            text = self._lower(state, batch).as_text()
        sizes = []
        for match in re.finditer(r"stablehlo\.constant dense[^\n]*?: tensor<([^>]*)>", text):
            *dims, dtype = match.group(1).split("x")
            bits = int(re.sub(r"\D", "", dtype) or 32)
            sizes.append(math.prod(int(d) for d in dims) * max(bits // 8, 1))
        return sorted(sizes, reverse=True)

    def warm_up(self, state: Any, batch: Any) -> None:
        """Trace and lower the step for ``(state, batch)``'s shapes, so that a first
        :meth:`step` on a batch of these shapes finds its jaxpr and MLIR already made and only
        compiles (or loads from the compilation cache). Runs nothing, donates nothing, and
        compiles nothing that a batch of other shapes would leave unused."""
        with self._context():
            self._lower(state, batch)

    def _lower(self, state: Any, batch: Any) -> Any:
        """JAX's ``Lowered`` train step for ``(state, batch)`` (inside :meth:`_context`)."""
        import haliax as hax

        batch = hax.shard(batch, self.compute_axis_mapping)
        # The step levanter runs when jit hooks (the gradient-norm watch) are due: every step.
        return self._trainer()._jit_train_step_fn.lower(state, (batch,), self._frozen)

    def prepare(self, state: Any, batches: list[Any]) -> list[Any]:
        """``batches`` (the minibatches of one trainer step), sharded, each with
        ``prepared`` set to what the loss's preparation computes from ``state``'s model before
        any of the step's updates; unchanged (but sharded) when the loss prepares nothing."""
        import equinox as eqx
        import haliax as hax

        with self._context():
            batches = [hax.shard(b, self.compute_axis_mapping) for b in batches]
            if self._prepare is None:
                return batches
            outs = self._prepare(state.model, tuple(batches), self._frozen)
        return [
            eqx.tree_at(lambda b: b.prepared, b, dict(out), is_leaf=lambda x: x is None)
            for b, out in zip(batches, outs, strict=True)
        ]

    def step(self, state: Any, batch: Any) -> tuple[Any, float, dict[str, float]]:
        """One optimizer step: ``(new_state, loss, metrics)``. ``state`` is donated."""
        import haliax as hax

        with self._context():
            batch = hax.shard(batch, self.compute_axis_mapping)
            self.tracker.latest.clear()
            info = self._trainer().train_step(state, batch, **self._frozen)
            metrics: dict[str, float] = {}
            for name, value in self.tracker.latest.items():
                if name.startswith("train/"):
                    metrics[name.removeprefix("train/")] = float(np.asarray(value))
                elif name == "grad/norm/total":
                    metrics["grad_norm"] = float(np.asarray(value))
        return info.state, float(info.loss), metrics
