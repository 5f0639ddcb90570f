"""``[trainer.mesh]``: how the learner lays its devices out, and what that layout makes of a
number of devices and a batch (re-exported by :mod:`marin_rl_core.config.schema`)."""

from __future__ import annotations

import attrs

from marin_rl_core.errors import ConfigError

__all__ = ["MeshConfig"]


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

    def sizes(self, n_devices: int, batch_size: int, microbatch_size: int = 0) -> dict[str, int]:
        """``{"data_parallel", "fsdp", "tensor_parallel", "batch_shards"}`` of this layout on
        ``n_devices``; raises :class:`~marin_rl_core.errors.ConfigError` for a layout that does
        not fit (the message says what would)."""
        tp = self.tensor_parallel
        dp = n_devices // tp if self.data_parallel == -1 else self.data_parallel
        if dp < 1 or n_devices % (dp * tp):
            raise ConfigError(
                f"$.trainer.mesh: the trainer has {n_devices} device(s), which cannot be split into "
                f"data_parallel={self.data_parallel} x tensor_parallel={tp} groups; choose sizes whose "
                f"product divides {n_devices}"
            )
        fsdp = n_devices // (dp * tp)
        shards = dp * fsdp
        rows = microbatch_size or batch_size
        if rows % shards:
            what = "microbatch_size" if microbatch_size else "batch_size"
            raise ConfigError(
                f"$.trainer.{what}: {rows} rows cannot be split evenly over the {shards} data shards "
                f"of the trainer's {n_devices} device(s) (data_parallel={dp} x fsdp={fsdp}); use a "
                f"multiple of {shards}"
            )
        return {"data_parallel": dp, "fsdp": fsdp, "tensor_parallel": tp, "batch_shards": shards}
