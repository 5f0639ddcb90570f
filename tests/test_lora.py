"""LoRA (issue 61): a policy of low-rank adapters on a frozen base starts as the base, trains
only its adapters (their gradients and optimizer state alone), takes its KL reference from the
base inside it, and is sampled, resumed and exported with the adapters merged in."""

from __future__ import annotations

import json

import equinox as eqx
import jax
import numpy as np
import pytest
import torch
import transformers
from test_learner import short_rollouts

from marin_rl_core import build_registry
from marin_rl_core.config import resolve_config
from marin_rl_core.errors import ConfigError
from marin_rl_core.learner.checkpoint import checkpoints_newest_first
from marin_rl_core.metrics import read_metrics
from marin_rl_core.models.build import initial_model
from marin_rl_core.models.logprobs import response_logprobs
from marin_rl_core.models.lora import (
    AdaptedBase,
    adapter_parameter_count,
    has_adapters,
    parameter_count,
    sampled_in_place,
    without_adapters,
)
from marin_rl_core.testing import write_tiny_hf_checkpoint

LORA = ["model.lora.rank=4", "model.num_layers=2"]


def lora_job(*overrides: str):
    registry = build_registry()
    config = resolve_config(
        registry,
        selections={"env": "math", "loss": "rloo"},
        overrides=["trainer.batch_size=8", "trainer.learning_rate=0.01", *overrides],
    )
    return registry, config


def logprobs_of(model, tok, rollouts, max_seq_len):
    return response_logprobs(
        model,
        [r.prompt_tokens for r in rollouts],
        [r.response_tokens for r in rollouts],
        max_seq_len=max_seq_len,
        pad_id=tok.pad_id,
    )


def arrays(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def test_a_lora_policy_starts_as_its_base_model_and_is_published_as_it(tmp_path):
    """Step 0: the adapted policy's log-probabilities are the base model's, exactly (levanter
    draws ``lora_B`` at random; marinrl zeroes it), and what samplers get (the merged policy)
    has the base's structure and its very weights."""
    from marin_rl_core.learner.trainer import Trainer

    registry, config = lora_job(*LORA)
    trainer = Trainer(config, registry, run_dir=tmp_path, storage=None)
    base = initial_model(config, trainer.tokenizer)
    assert has_adapters(trainer.model) and not has_adapters(trainer.merged_model)
    rollouts = short_rollouts(8, trainer.tokenizer, 4)
    for got, want in zip(
        logprobs_of(trainer.model, trainer.tokenizer, rollouts, config.model.max_seq_len),
        logprobs_of(base, trainer.tokenizer, rollouts, config.model.max_seq_len),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)
    served = trainer.merged_model
    assert jax.tree.structure(served) == jax.tree.structure(base)
    for got, want in zip(arrays(served), arrays(base), strict=True):
        np.testing.assert_array_equal(got, want)


def test_only_the_adapters_train_and_hold_optimizer_state(tmp_path):
    """Two steps with a KL penalty: the base weights stay bit for bit, the adapters move; the
    optimizer's state is the adapters' size (a few percent of full fine-tuning's); the KL
    reference is the base inside the policy (zero KL at step 1, positive after), an argument of
    nothing: no weights compiled into the step."""
    from marin_rl_core.learner.trainer import Trainer

    registry, config = lora_job(*LORA, "loss.kl_coef=0.05")
    trainer = Trainer(config, registry, run_dir=tmp_path / "lora", storage=None)
    base_before = arrays(without_adapters(trainer.model))
    adapters = adapter_parameter_count(trainer.model)
    total = parameter_count(trainer.model)
    assert 0 < adapters < 0.1 * total
    opt_numbers = parameter_count(trainer.state.opt_state)
    assert 2 * adapters <= opt_numbers <= 2 * adapters + 64, (opt_numbers, adapters)
    full_registry, full_config = lora_job("model.num_layers=2", "loss.kl_coef=0.05")
    full = Trainer(full_config, full_registry, run_dir=tmp_path / "full", storage=None)
    assert opt_numbers < 0.1 * parameter_count(full.state.opt_state)
    del full

    rollouts = short_rollouts(8, trainer.tokenizer, 3)
    batch = trainer.updates.training_batch(rollouts, np.linspace(-1, 1, 8).astype(np.float32))
    constants = trainer.learner.constant_bytes(trainer.state, batch)
    assert constants[0] <= 1024, constants[:5]
    state, loss, first = trainer.learner.step(trainer.state, batch)
    assert np.isfinite(loss) and abs(first["kl"]) < 1e-6 and first["grad_norm"] > 0
    batch = trainer.updates.training_batch(rollouts, np.linspace(-1, 1, 8).astype(np.float32))
    state, loss, second = trainer.learner.step(state, batch)
    assert np.isfinite(loss) and second["kl"] > 0
    trainer.state = state

    for got, want in zip(arrays(without_adapters(trainer.model)), base_before, strict=True):
        np.testing.assert_array_equal(got, want)
    # A colocated sampler is handed the policy on the trainer's very base arrays, which no
    # later step frees or replaces (the step does not donate them): no copy of the base.
    handed = sampled_in_place(trainer.model, config.model.resolved_inference_dtype)
    trainer.state, _, _ = trainer.learner.step(trainer.state, batch)
    base_of = lambda m: jax.tree.leaves(eqx.filter(without_adapters(m), eqx.is_array))  # noqa: E731
    for handed_x, trainer_x in zip(base_of(handed), base_of(trainer.model), strict=True):
        assert handed_x is trainer_x and not handed_x.is_deleted()
    assert not has_adapters(trainer.merged_model) and has_adapters(handed)
    lora_b = trainer.model.transformer.layers.stacked.self_attn.q_proj.lora.lora_B.weight
    assert np.abs(np.asarray(lora_b.array)).max() > 0, "the adapters did not train"
    # A sampler apart receives the adapters alone and merges them into the base it loaded:
    # the very model a colocated sampler is handed.
    sampler = AdaptedBase(
        initial_model(config, trainer.tokenizer), config.model.lora,
        dtype="float32", key=jax.random.PRNGKey(99),
    )  # fmt: skip
    served = trainer._served()
    assert parameter_count(served) == adapters
    for got, want in zip(arrays(sampler.merged(served)), arrays(trainer.merged_model), strict=True):
        np.testing.assert_array_equal(got, want)
    # The sampler's merged policy computes what the trainer's adapted one does.
    for got, want in zip(
        logprobs_of(trainer.merged_model, trainer.tokenizer, rollouts, config.model.max_seq_len),
        logprobs_of(trainer.model, trainer.tokenizer, rollouts, config.model.max_seq_len),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_a_lora_target_no_model_has_is_a_config_error():
    targets = r"(?s)qproj.*choose from q_proj.*\$\.model\.lora\.targets"
    with pytest.raises(ConfigError, match=targets):
        lora_job("model.lora.rank=4", 'model.lora.targets=["qproj"]')
    with pytest.raises(ConfigError, match=r"'rank' must be >= 0.*\$\.model\.lora"):
        lora_job("model.lora.rank=-1")


def test_a_lora_job_on_a_checkpoint_trains_resumes_and_exports_the_merged_policy(cli, tmp_path):
    """Through ``marinrl run`` on a tiny Qwen3 checkpoint: a LoRA job (colocated, the kv
    engine) trains with a KL penalty, resumes from its adapters-only checkpoint (adapters and
    their optimizer state, read onto the base loaded again), and ``marinrl export``
    writes the merged policy: transformers loads it and computes what the run's policy
    computes, its layers without adapters (the embeddings) exactly the checkpoint's."""
    from test_hf_models import (
        SMALL_JOB,
        check_trained_and_exported,
        prompt_rows,
        transformers_logits,
    )

    source = write_tiny_hf_checkpoint(tmp_path / "base", "qwen3")
    args = [
        "--model", str(source), *SMALL_JOB, "--set", "model.lora.rank=4",
        "--set", "loss.kl_coef=0.05", "--set", "trainer.learning_rate=0.05",
        "--set", "resources.colocate=true", "--set", 'engine.name="kv"',
    ]  # fmt: skip
    run_dir = tmp_path / "lora"
    first = ["--set", "trainer.num_train_steps=2", "--set", f'run_dir="{tmp_path}"']
    result = cli("run", *args, *first, "--run-id", "lora")
    assert result.exit_code == 0, result.output
    result = cli("run", "--resume", str(run_dir), "--set", "trainer.num_train_steps=3")
    assert result.exit_code == 0, result.output
    train = [r for r in read_metrics(run_dir) if r["source"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(np.isfinite(r["kl"]) for r in train) and train[-1]["kl"] > 0
    assert all(r["mean_weight_lag"] == 0 for r in train)  # colocated: on-policy
    assert checkpoints_newest_first(run_dir)[0].name == "step-000003"

    # marinrl eval: the merged policy of the newest checkpoint, on the run's held-out problems
    evaluated = cli("eval", str(run_dir), "--n-examples", "8")
    assert evaluated.exit_code == 0, evaluated.output
    assert "│ add" in evaluated.output and "problems" in evaluated.output, evaluated.output
    out = tmp_path / "export"
    result = cli("export", str(run_dir), str(out))
    assert result.exit_code == 0, result.output
    check_trained_and_exported(source, run_dir, out, "qwen3")
    import safetensors.numpy

    def weights(path):
        found = {}
        for file in path.glob("*.safetensors"):
            found.update(safetensors.numpy.load_file(file))
        return found

    before, after = weights(source), weights(out)
    # The checkpoints hold the adapters alone (the base is read again from model.checkpoint), so
    # the layers without adapters come out exactly as the base checkpoint has them.
    name = "model.embed_tokens.weight"
    np.testing.assert_array_equal(after[name], before[name])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert np.abs(after[q].astype(np.float32) - before[q].astype(np.float32)).max() > 0

    # The checkpoint holds the adapters (and their optimizer state), not the base, and names it.
    newest = checkpoints_newest_first(run_dir)[0]
    stored = {p.relative_to(newest).as_posix() for p in (newest / "model").rglob("*")}
    assert any("/lora/lora_A" in p for p in stored) and not any("wrapped" in p for p in stored)
    assert not any("embed" in p for p in stored), sorted(stored)[:5]
    base = json.loads((newest / "state.json").read_text())["lora_base"]
    assert base["checkpoint"] == str(source) and len(base["weights_sha256"]) == 64

    # --adapter: a PEFT folder that peft loads onto the base, computing what the merged export
    # computes.
    peft = pytest.importorskip("peft")
    adapter_dir = tmp_path / "adapter"
    result = cli("export", str(run_dir), str(adapter_dir), "--adapter")
    assert result.exit_code == 0, result.output
    assert "PeftModel.from_pretrained" in result.output, result.output
    rows = prompt_rows(source)
    base_model = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    base_logits = logits_of(base_model, rows)
    with_adapters = peft.PeftModel.from_pretrained(base_model, str(adapter_dir))
    np.testing.assert_allclose(
        logits_of(with_adapters, rows), transformers_logits(out, rows), atol=2e-4, rtol=1e-4
    )
    assert np.abs(logits_of(with_adapters, rows) - base_logits).max() > 1e-3

    # A base that changed since training is refused (exit 3, naming it) by resume, export, eval.
    weights_file = next(source.glob("*.safetensors"))
    tensors = safetensors.numpy.load_file(weights_file)
    tensors[q] = tensors[q] * 1.01
    safetensors.numpy.save_file(tensors, weights_file, metadata={"format": "pt"})
    for command in (
        ["run", "--resume", str(run_dir), "--set", "trainer.num_train_steps=4"],
        ["export", str(run_dir), str(tmp_path / "again")],
        ["eval", str(run_dir), "--n-examples", "2"],
    ):
        result = cli(*command)
        assert result.exit_code == 3, (command, result.output)
        assert "is not the base the adapters of step-000003 were trained on" in result.output
        assert "weights differ" in result.output, result.output
    assert not (tmp_path / "again").exists()


def logits_of(model, rows):
    with torch.no_grad():
        return model(torch.tensor(rows)).logits.numpy()


def test_ppo_with_lora_trains_the_adapters_and_its_critic_and_keeps_the_base(tmp_path):
    """A loss with trainable state of its own (ppo's critic), several updates per step and a
    KL reference in its preparation: the critic and the adapters train, the base stays."""
    from test_losses import rollouts

    from marin_rl_core.learner.loss import policy_of
    from marin_rl_core.learner.trainer import Trainer

    registry = build_registry()
    config = resolve_config(
        registry, selections={"env": "mock", "loss": "ppo"},
        overrides=[*LORA, "trainer.batch_size=8", "sampling.n_generations_per_prompt=2",
                   "model.max_seq_len=24", "loss.kl_coef=0.05", "loss.epochs=2",
                   "loss.minibatches=2", "trainer.learning_rate=0.01", "trainer.warmup_steps=0"],
    )  # fmt: skip
    trainer = Trainer(config, registry, run_dir=tmp_path, storage=None)
    base = arrays(without_adapters(trainer.model))
    critic = arrays(trainer.state.model.loss_state)
    rs = rollouts(8, seed=3, lesson="mock")
    first = trainer.train_one_step(rs, np.zeros(8, np.float32))
    second = trainer.train_one_step(rs, np.zeros(8, np.float32))
    assert int(trainer.state.step) == 8 and np.isfinite(second["loss"])
    # The policy drifts from the base over the step's 4 updates, and further in the next.
    assert 0 < first["kl"] < second["kl"]
    for got, want in zip(arrays(without_adapters(trainer.model)), base, strict=True):
        np.testing.assert_array_equal(got, want)
    moved = [np.abs(a - b).max() for a, b in zip(arrays(trainer.state.model.loss_state), critic)]
    assert max(moved) > 0, "the critic did not train"
    lora_b = policy_of(trainer.state.model).transformer.layers.stacked.mlp.down_proj.lora.lora_B
    assert np.abs(np.asarray(lora_b.weight.array)).max() > 0, "the adapters did not train"


def test_samplers_apart_receive_the_adapters_alone_and_sample_the_trainers_policy(
    cli, tmp_path, tiny_mock_job
):
    """A LoRA job whose rollout worker runs apart (grpo, a multi-turn env, object storage, the
    paged engine): each publish moves the adapters alone (every receive is a whole number of
    adapter sets, in bytes: under a tenth of the model), and the worker merges them into the
    base it loaded (the merge itself is checked against the trainer's in
    ``test_only_the_adapters_train_and_hold_optimizer_state``); on-policy, the trainer's and the
    sampler's log-probabilities agree."""
    from marin_rl_core.models.lora import add_adapters
    from marin_rl_core.models.tokenizer import model_tokenizer

    job = [a if a != "mock" else "guess" for a in tiny_mock_job]
    result = cli(
        "run", *job, "--loss", "grpo", "--storage", "gcs", "--set", 'engine.name="paged"',
        "--set", "model.lora.rank=4", "--set", "loss.kl_coef=0.05",
        "--set", "trainer.learning_rate=0.05", "--set", "trainer.num_train_steps=3",
        "--set", "resources.colocate=false", "--set", "replay_buffer.max_rollout_step_delay=0",
        # (the guess lesson's own 32 prompts a batch: 4 fill the trainer's batch of 32)
        "--set", "curriculum.lessons[0].sampling.n_prompts=4",
        "--set", f'run_dir="{tmp_path}"', "--run-id", "apart",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "memory: the job needs about" in result.output  # the check's estimate, said
    rows = read_metrics(tmp_path / "apart")
    _, config = lora_job("model.lora.rank=4")
    model = initial_model(config, model_tokenizer(config.model))
    adapters_bytes = 4 * adapter_parameter_count(
        add_adapters(model, config.model.lora, key=jax.random.PRNGKey(0))
    )
    received = [r["rollout/weights_bytes"] for r in rows if r.get("rollout/weights_bytes")]
    assert received and all(b % adapters_bytes == 0 for b in received), (received, adapters_bytes)
    assert adapters_bytes < 0.1 * 4 * parameter_count(model)
    train = [r for r in rows if r["source"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(r["mean_weight_lag"] == 0 for r in train)
    assert all(abs(r["sampler_kl"]) < 1e-5 for r in train), [r["sampler_kl"] for r in train]
    # What trains, in the first row (and trainer.log): the adapters, Adam's two moments of them.
    first = train[0]
    assert first["params/trainable"] * 4 == adapters_bytes
    assert first["params/total"] == parameter_count(model) + adapters_bytes / 4
    assert 2 * adapters_bytes <= first["params/optimizer_state_bytes"] <= 2 * adapters_bytes + 64
    assert "params/total" not in train[1]
    log = (tmp_path / "apart" / "logs" / "trainer.log").read_text()
    assert "parameters (" in log and "LoRA rank 4); optimizer state" in log
    assert any(r.get("rollout/turns", 0) > 1 for r in rows), "a multi-turn env"
