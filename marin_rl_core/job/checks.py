"""What the driver checks before it starts anything: the cluster answers and can place every
actor, the model's settings hold together, a resumed run's config matches its checkpoints, the
run directory can be written; and the one-line error text the driver shows."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

from marin_rl_core.config.schema import RLJobConfig
from marin_rl_core.errors import (
    ClusterError,
    RunDirError,
)
from marin_rl_core.rundir import is_remote

_UNSET: Any = object()


def _format_resources(resources: dict[str, float]) -> str:
    def one(name: str, amount: float) -> str:
        if name == "memory":
            return f"{amount / 2**30:.1f} GiB memory"
        return f"{amount:g} {name}"

    return ", ".join(one(k, v) for k, v in sorted(resources.items())) or "nothing"


def check_resources(config: RLJobConfig, nodes: list[dict[str, float]]) -> None:
    """Refuse a job whose ``[resources]`` the cluster cannot meet, before any actor starts (Ray
    would leave such an actor pending forever).

    Args:
        config: the run config.
        nodes: the resources of each live node (``ray.nodes()[i]["Resources"]``).

    Raises:
        ResourcesUnavailableError: naming what each role asks for and what the cluster has.
    """
    from marin_rl_core.errors import ResourcesUnavailableError

    cluster: dict[str, float] = {}
    for node in nodes:
        for name, amount in node.items():
            if (
                not name.startswith(("node:", "accelerator_type:"))
                and name != "object_store_memory"
            ):
                cluster[name] = cluster.get(name, 0.0) + amount
    hosts = config.resources.trainer_hosts
    roles = [
        (
            "the trainer" if hosts == 1 else f"each of the trainer's {hosts} hosts",
            "resources.trainer",
            config.resources.trainer.requested(),
            hosts,
        ),
        (
            "each rollout worker",
            "resources.rollout",
            config.resources.rollout.requested(),
            config.num_rollout_workers,
        ),
    ]
    if config.resources.colocate is True:  # one process: the trainer's resources
        roles = roles[:1]
    problems, total = [], {}
    for role, path, asked, count in roles:
        for name, amount in asked.items():
            total[name] = total.get(name, 0.0) + amount * count
        if asked and not any(
            all(node.get(k, 0.0) >= v for k, v in asked.items()) for node in nodes
        ):
            problems.append(
                f"{role} asks for {_format_resources(asked)} ($.{path}), and no node has that"
            )
    short = {k: v for k, v in total.items() if cluster.get(k, 0.0) < v}
    if short and not problems:
        problems.append(
            f"together {'the trainer' if hosts == 1 else f'the trainer hosts ({hosts})'} and "
            f"{config.num_rollout_workers} rollout worker(s) ask for "
            f"{_format_resources(short)}"
        )
    if problems:
        raise ResourcesUnavailableError(
            "the Ray cluster cannot run this job: "
            + "; ".join(problems)
            + f". The cluster has {_format_resources(cluster)}"
            + (f" on {len(nodes)} nodes" if len(nodes) > 1 else "")
            + ". Lower those [resources] values (or num_rollout_workers, "
            "resources.trainer_hosts), or run on a cluster that has them (--ray-address; "
            "`ray start --num-gpus N --resources '{\"TPU\": 4}'` adds a node's resources)."
        )


def check_model(config: RLJobConfig) -> list[str]:
    """Problems of the ``[model]`` section found without building the model: the checkpoint
    exists and is a supported architecture, its tokenizer loads and fits its vocabulary, and
    ``max_seq_len`` fits its context length. Returns error lines; raises :class:`ConfigError`
    for a checkpoint that cannot be found at all."""
    from marin_rl_core.models.pretrained import check_vocab, context_length, read_pretrained_info
    from marin_rl_core.models.tokenizer import model_tokenizer

    model = config.model
    if not model.checkpoint and model.tokenizer in ("auto", "arithmetic"):
        return []
    if model.checkpoint:
        read_pretrained_info(model.checkpoint)  # exists, and an architecture marinrl trains
    try:
        tokenizer = model_tokenizer(model)
    except ValueError as exc:
        return [f"$.model.tokenizer: {exc}"]
    if not model.checkpoint:
        return []
    check_vocab(model, tokenizer)
    errors = []
    limit = context_length(model)
    if limit is not None and model.max_seq_len > limit:
        errors.append(
            f"$.model.max_seq_len ({model.max_seq_len}) is longer than the checkpoint's context "
            f"length (max_position_embeddings = {limit}); lower it to at most {limit}"
        )
    return errors


STATE_SHAPING_MODEL_FIELDS = ("checkpoint", "tokenizer", "resize_vocab")
"""``[model]`` settings that decide what a checkpoint holds, for any model; the default model's
shape fields count too when no checkpoint is set."""
DEFAULT_MODEL_SHAPE_FIELDS = (
    "hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads",
)  # fmt: skip


def resume_conflicts(
    saved: RLJobConfig, new: RLJobConfig, run_dir: Path | None = None
) -> list[str]:
    """Settings of ``new`` that change what the checkpoints of a run saved with ``saved`` hold
    (the model's shape, vocabulary, parameter dtype), as ``"model.hidden_dim: 64 -> 128"``: a
    resume with them could not load the run's checkpoints. Empty when they load. With
    ``run_dir``, a LoRA run's newest checkpoint is also checked to name the base ``new`` loads
    (:func:`~marin_rl_core.learner.lora_checkpoint.base_problem`)."""
    fields = list(STATE_SHAPING_MODEL_FIELDS)
    if not saved.model.checkpoint and not new.model.checkpoint:
        fields += DEFAULT_MODEL_SHAPE_FIELDS
    out = [
        f"model.{name}: {getattr(saved.model, name)!r} -> {getattr(new.model, name)!r}"
        for name in fields
        if getattr(saved.model, name) != getattr(new.model, name)
    ]
    # The adapters' shapes and which layers have them (and their scale, what they mean).
    out += [
        f"model.lora.{name}: {getattr(saved.model.lora, name)!r} -> "
        f"{getattr(new.model.lora, name)!r}"
        for name in ("rank", "targets", "alpha")
        if getattr(saved.model.lora, name) != getattr(new.model.lora, name)
    ]
    dtypes = [
        c.trainer.mp_policy(hf_checkpoint=bool(c.model.checkpoint)).param_dtype
        for c in (saved, new)
    ]
    if dtypes[0] != dtypes[1]:
        out.append(
            f"trainer.precision: {saved.trainer.precision!r} -> {new.trainer.precision!r} "
            f"(parameters in {dtypes[0].__name__} -> {dtypes[1].__name__})"
        )
    if run_dir is not None and not out:
        from marin_rl_core.learner.checkpoint import latest_checkpoint
        from marin_rl_core.learner.lora_checkpoint import base_problem

        newest = latest_checkpoint(run_dir)
        problem = None if newest is None else base_problem(newest, new)
        out += [problem] if problem else []
    return out


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


RUN_DIR_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.ENOTDIR,
    errno.EEXIST,
}


def run_dir_error(exc: OSError, run_dir: Path, *, resumable: bool) -> RunDirError:
    """A :class:`RunDirError` for an ``OSError`` writing the run directory, with the fix."""
    what = exc.filename or run_dir
    fixes = {
        errno.ENOSPC: "free some space there",
        errno.EDQUOT: "free some space there",
        errno.EROFS: "choose a writable run_dir",
        errno.EACCES: "choose a run_dir you may write to",
        errno.EPERM: "choose a run_dir you may write to",
        errno.ENOTDIR: "a file is in the way: choose another run_dir",
        errno.EEXIST: "a file is in the way: choose another run_dir",
    }
    fix = fixes.get(exc.errno or 0, "check the run directory")
    resume = f", then resume with `marinrl run --resume {run_dir}`" if resumable else ""
    return RunDirError(f"cannot write {what}: {exc.strerror or exc}; {fix}{resume}")


def preflight_problems(config: RLJobConfig, registry: Any) -> list[str]:
    """What each lesson's env plugin's ``preflight`` finds wrong with its env config (a data file
    that does not exist, a package not installed), prefixed with the lesson, and each reward
    term's plugin with its config (a judge without an endpoint), prefixed with the term."""
    from marin_rl_core.config.converter import lesson_env_config, make_converter

    problems = []
    for i, lesson in enumerate(config.curriculum.lessons):
        name, env_config = lesson_env_config(config, lesson, registry)
        preflight = getattr(registry.get("env", name), "preflight", None)
        for problem in preflight(env_config) if preflight is not None else ():
            problems.append(f"$.curriculum.lessons[{i}] ({lesson.id!r}, env {name}): {problem}")
    converter = make_converter(registry)
    for i, term in enumerate(config.reward.terms):
        record = registry.get("reward", term.plugin)
        if record.preflight is not None:
            settings = converter.structure(dict(term.config), record.config_class)
            for problem in record.preflight(settings):
                problems.append(f"$.reward.terms[{i}] ({term.name!r}, fn {term.plugin}): {problem}")
    return problems


FILESYSTEM_EXTRAS = {"s3": "pip install 'marin-rl[s3]'", "s3a": "pip install 'marin-rl[s3]'"}
"""How to install the filesystem of a bucket URL, by protocol (gs:// comes with levanter)."""


def check_run_dir_filesystem(run_dir: str) -> None:
    """Refuse a run directory on a bucket whose fsspec filesystem is not installed
    (``s3://`` without ``s3fs``), before anything is written, with the install command.

    Raises:
        RunDirError: naming the URL and what to install.
    """
    if not is_remote(run_dir):
        return
    import fsspec

    protocol = fsspec.core.split_protocol(str(run_dir))[0] or "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        install = FILESYSTEM_EXTRAS.get(protocol, f"install the fsspec filesystem of {protocol}://")
        raise RunDirError(
            f"cannot use the run directory {run_dir}: {first_line(exc)}; {install}, or choose a "
            "local run_dir"
        ) from None


def check_run_dir_writable(run_dir: Path) -> None:
    """Refuse a local run directory that cannot be created or written (a file in its path, a
    directory this user may not write, a read-only filesystem) before the job starts Ray and
    its workers, writing nothing: the nearest part of the path that exists must be a directory
    this process may write to. (What a write meets later, a full disk, is still told then.)

    Raises:
        RunDirError: naming the path and the fix, as a failed write would.
    """
    import os

    if is_remote(run_dir):
        return
    existing = Path(run_dir)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        exc = OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(existing))
        raise run_dir_error(exc, Path(run_dir), resumable=False)
    if not os.access(existing, os.W_OK | os.X_OK):
        code = errno.EROFS if _read_only(existing) else errno.EACCES
        raise run_dir_error(OSError(code, os.strerror(code), str(existing)), Path(run_dir),
                            resumable=False)  # fmt: skip


def checked_storage(config: RLJobConfig, registry: Any, run_id: str, run_dir: Path) -> Any:
    """The job's rollout storage, built and, where it has a ``check()`` (a bucket that answers:
    the ``gcs`` storage's), checked before the job starts Ray and its workers; the actors get
    this one. A failed check closes it."""
    from marin_rl_core.types import RunInfo

    storage = registry.get("storage", config.storage.name).build(
        config.storage.config, RunInfo(run_id=run_id, run_dir=str(run_dir))
    )
    if getattr(storage, "check", None) is not None:
        try:
            storage.check()
        except BaseException:
            storage.close()
            raise
    return storage


def _read_only(path: Path) -> bool:
    import os

    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def bucket_error(exc: BaseException, run_dir: Any) -> RunDirError:
    """A :class:`RunDirError` for a run directory on a bucket that cannot be written (no such
    bucket, no credentials, no answer), with the fix."""
    return RunDirError(
        f"cannot write the run directory {run_dir}: {type(exc).__name__}: {first_line(exc)}. "
        "Check that the bucket exists and that this machine's credentials may write to it "
        "(for gs://, `gcloud auth application-default login`), or choose a local run_dir."
    )


def probe_ray_address(address: str, *, timeout: float = 5.0) -> None:
    """Raise :class:`ClusterError` unless something accepts connections at ``address``
    (``HOST:PORT``, ``ray://HOST:PORT``; ``auto`` is left to Ray). A wrong address would
    otherwise have Ray retry for minutes."""
    import socket

    if address == "auto":
        return
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterError(
            f"--ray-address {address!r} is not HOST:PORT (the address `ray start --head` prints, "
            "for example 127.0.0.1:6379)"
        )
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        if isinstance(exc, TimeoutError | socket.timeout):
            reason = f"no answer within {timeout:g} s"
        raise ClusterError(
            f"nothing answers at {address} (--ray-address / $.ray_address): {reason}. Start the "
            f"cluster's head there (`ray start --head --port {port}`), correct the address, or "
            "leave --ray-address out to start a local Ray."
        ) from None
