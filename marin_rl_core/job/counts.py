"""The parameters a job trains, counted for the memory check (:mod:`marin_rl_core.job.memory`)
before anything starts: the policy (with its LoRA adapters) and a loss's own state (ppo's
critic) built abstractly (``jax.eval_shape``: shapes only, no weights read), and the shapes the
activations depend on.

Counting imports levanter and traces the model's construction, ~5 s of a ``marinrl run``'s
start on a 2-core machine, so the counts are kept in
:func:`~marin_rl_core.rundir.cache_dir` ``("model-counts")`` (``~/.cache/marinrl/model-counts``)
under a hash of everything they depend on: the ``[model]`` section, the files of a local
checkpoint and tokenizer, the loss's name, config and plugin module, marinrl's own modules and
the versions of levanter and what it builds on. The next job of the same model reads them.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import attrs

from marin_rl_core.config.schema import RLJobConfig

logger = logging.getLogger(__name__)


@attrs.frozen
class ModelCounts:
    """Parameter counts of what a job trains, and the shapes the activations depend on."""

    total: int  # the policy's parameters (a LoRA policy's base and adapters)
    trainable: int  # trained: the adapters (or the whole policy) and a loss's own state
    frozen: int  # not trained: a LoRA base
    loss_state: int  # a loss's own trained state (a critic), part of ``trainable``
    reference: bool  # the loss keeps a KL reference model (its ``needs_reference_model``)
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


def model_counts(config: RLJobConfig, registry: object) -> ModelCounts:
    """Count the parameters a job of ``config`` trains, building nothing but shapes, or read
    the counts kept for the same model (see the module docstring)."""
    path = _counts_path(config, registry)
    cached = _read_counts(path)
    if cached is not None:
        return cached
    counts = _count(config, registry)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(attrs.asdict(counts)))
        partial.replace(path)
    except OSError as exc:  # a read-only home: counted again next time, nothing else
        logger.debug("cannot keep the model's counts in %s: %s", path, exc)
    return counts


def _read_counts(path: Path) -> ModelCounts | None:
    """The counts kept at ``path``; ``None`` when there are none or they are not a valid set of
    counts (a partly written or edited file: counted again)."""
    try:
        data = json.loads(path.read_text())
        fields = {f.name: f.type for f in attrs.fields(ModelCounts)}
        if not isinstance(data, dict) or set(data) != set(fields):
            return None
        for name, kind in fields.items():
            want = bool if kind in (bool, "bool") else int
            if type(data[name]) is not want:
                return None
        return ModelCounts(**data)
    except (OSError, ValueError):
        return None


def _counts_path(config: RLJobConfig, registry: object) -> Path:
    """Where the counts of ``config``'s model are kept: a hash of what they depend on."""
    import hashlib
    import inspect
    from importlib import metadata

    import marin_rl_core
    from marin_rl_core.rundir import cache_dir

    def versions(*names: str) -> dict[str, str | None]:
        found: dict[str, str | None] = {}
        for name in names:
            try:
                found[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                found[name] = None
        return found

    def stamp(where: str) -> object:
        """A local file's or directory's files' sizes and times; anything else (a hub id, the
        built-in tokenizer) as named."""
        path = Path(where).expanduser()
        if path.is_file():
            return [path.stat().st_size, path.stat().st_mtime_ns]
        if path.is_dir():
            return sorted(
                [p.name, p.stat().st_size, p.stat().st_mtime_ns]
                for p in path.iterdir()
                if p.is_file()
            )
        return where

    def code(root: Path) -> list[object]:
        """marinrl's own modules (an editable install changes without a new version)."""
        return sorted(
            [str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns]
            for p in root.rglob("*.py")
        )

    record = registry.get("loss", config.loss.name)  # type: ignore[attr-defined]
    try:
        loss_code = stamp(inspect.getfile(record.build))
    except (TypeError, OSError):  # built in code with no file: its name and config only
        loss_code = None
    key = {
        "model": attrs.asdict(config.model),
        "checkpoint": stamp(config.model.checkpoint) if config.model.checkpoint else None,
        "tokenizer": stamp(config.model.tokenizer),
        "loss": [config.loss.name, repr(config.loss.config), loss_code],
        "marinrl": code(Path(marin_rl_core.__file__).parent),
        "versions": versions("marin-rl", "levanter", "haliax", "equinox", "jax", "transformers"),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return cache_dir("model-counts") / f"{digest[:32]}.json"


def _count(config: RLJobConfig, registry: object) -> ModelCounts:
    """:func:`model_counts`, counted."""
    import equinox as eqx
    import jax

    from marin_rl_core.learner.loss import TrainedModel, loss_plan, with_loss_state
    from marin_rl_core.models.lora import add_adapters as adapt
    from marin_rl_core.models.lora import parameter_count, trainable_filter

    levanter_config, vocab = _levanter_config(config)
    lora = config.model.lora.enabled
    loss = registry.get("loss", config.loss.name).build(config.loss.config)  # type: ignore[attr-defined]
    plan = loss_plan(loss.build(None))

    def build() -> object:
        import haliax as hax

        key = jax.random.PRNGKey(0)
        model = levanter_config.build(hax.Axis("vocab", vocab), key=key)
        if lora:
            model = adapt(model, config.model.lora, key=key)
        trained, _ = with_loss_state(plan, model, key=key, learning_rate=1.0)
        return trained

    trained = eqx.filter_eval_shape(build)
    policy = trained.policy if isinstance(trained, TrainedModel) else trained
    state = trained.loss_state if isinstance(trained, TrainedModel) else None
    total = parameter_count(policy)
    state_count = parameter_count(state) if state is not None else 0
    adapters = parameter_count(eqx.filter(policy, trainable_filter(policy))) if lora else 0
    trainable = (adapters if lora else total) + state_count
    c = levanter_config
    heads = int(c.num_heads)
    return ModelCounts(
        total=total,
        trainable=trainable,
        frozen=total - adapters if lora else 0,
        loss_state=state_count,
        reference=bool(loss.needs_reference_model),
        layers=int(c.num_layers),
        hidden=int(c.hidden_dim),
        intermediate=int(c.intermediate_dim),
        heads=heads,
        kv_heads=int(c.num_kv_heads),
        head_dim=int(getattr(c, "head_dim", None) or c.hidden_dim // heads),
        vocab=vocab,
    )


def _levanter_config(config: RLJobConfig) -> tuple[object, int]:
    from marin_rl_core.models.build import checkpoint_levanter_config, llama_config
    from marin_rl_core.models.tokenizer import model_tokenizer

    model = config.model
    checkpointing = model.resolved_gradient_checkpointing
    if not model.checkpoint:
        return llama_config(model), model_tokenizer(model).vocab_size
    levanter_config, vocab = checkpoint_levanter_config(
        model.checkpoint, gradient_checkpointing=checkpointing
    )
    if model.resize_vocab:
        vocab = model_tokenizer(model).vocab_size
    return levanter_config, vocab
