"""Hugging Face models in and out, on tiny checkpoints that ``transformers`` writes here.

For Llama, Qwen2 and Qwen3: levanter's logits equal ``transformers``' on the checkpoint; the
checkpoint's own tokenizer and chat template shape the prompts; ``marinrl run --model DIR``
trains it for a few RL steps; ``marinrl export`` writes a checkpoint whose ``transformers``
logits equal the trained levanter model's. Bad models fail before anything starts.
"""

from __future__ import annotations

import json
import shlex
import tomllib
from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.layers.attention import AttentionMask

from marin_rl_core import Problem, build_registry
from marin_rl_core.config import ModelConfig
from marin_rl_core.errors import ExitCode
from marin_rl_core.learner.export import trained_model
from marin_rl_core.models.build import build_model, cast_floating
from marin_rl_core.models.tokenizer import HFTokenizer, encode_prompt, model_tokenizer
from marin_rl_core.testing import write_tiny_hf_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAMILIES = ["llama", "qwen2", "qwen3"]
END_OF_TURN = {"llama": "<|eot_id|>", "qwen2": "<|im_end|>", "qwen3": "<|im_end|>"}
# A few small steps (later --set values win, so these shrink any documented command).
FEW_SMALL_STEPS = [
    "--set", "trainer.num_train_steps=3",
    "--set", "trainer.batch_size=32",
    "--set", "sampling.n_prompts=4",
    "--set", "eval.n_examples=8",
    "--set", "eval.frequency=100",
    "--set", "trainer.learning_rate=0.01",
    # The tiny random checkpoints rarely answer right: weight decay is what moves them in 3
    # steps (the checks below see trained weights), at the tiny model's sampling temperature.
    "--set", "trainer.weight_decay=0.5",
    "--set", "sampling.temperature=1.5",
]  # fmt: skip
# One lesson, prompts through the chat template (about 12-16 tokens) plus a 2-token answer.
SMALL_JOB = [
    "--env", "math",
    "--set", "model.max_seq_len=24",
    "--set", "sampling.max_tokens=2",
    "--set", "eval.sampling.max_tokens=3",
    "--set", 'curriculum.lessons=[{id = "add", env_config = {task = "add_1digit"}}]',
    *FEW_SMALL_STEPS,
]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: write_tiny_hf_checkpoint(root / family, family) for family in FAMILIES}


@eqx.filter_jit
def _levanter_logits(model, ids):
    return model(ids, attn_mask=AttentionMask.causal())


def levanter_logits(model, rows: list[list[int]]) -> np.ndarray:
    """The model's logits computed in float32 (whatever its parameters' dtype), as
    ``transformers_logits`` computes them."""
    ids = hax.named(jnp.asarray(rows, dtype=jnp.int32), ("batch", "position"))
    model = cast_floating(model, jnp.float32)
    return np.asarray(_levanter_logits(model, ids).array, dtype=np.float32)


def transformers_logits(path: Path, rows: list[list[int]]) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(rows)).logits.numpy()


def prompt_rows(path: Path) -> list[list[int]]:
    tokenizer = model_tokenizer(ModelConfig(checkpoint=str(path)))
    chat = encode_prompt(tokenizer, Problem(id="p", prompt="12+7="))
    plain = tokenizer.encode("3*4=12 9-5=4 8+8=16", add_bos=True)
    width = max(len(chat), len(plain))
    # Equal lengths so both fit one batch; right padding does not change earlier positions.
    return [
        chat + [tokenizer.pad_id] * (width - len(chat)),
        plain + [tokenizer.pad_id] * (width - len(plain)),
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_levanter_logits_equal_transformers_logits(checkpoints, family):
    path = checkpoints[family]
    model = build_model(ModelConfig(checkpoint=str(path)), key=jax.random.PRNGKey(0))
    rows = prompt_rows(path)
    ours, theirs = levanter_logits(model, rows), transformers_logits(path, rows)
    # The checkpoint pads its vocabulary (192 rows, ~172 tokens): the model keeps every row.
    assert ours.shape == theirs.shape == (2, len(rows[0]), 192)
    assert np.abs(theirs).max() > 1.0  # logits that differ visibly, so equality means something
    np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_brings_its_tokenizer_chat_template_and_stop_tokens(checkpoints, family):
    tokenizer = model_tokenizer(ModelConfig(checkpoint=str(checkpoints[family])))
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template
    hf = tokenizer.to_hf()
    end_of_turn = hf.convert_tokens_to_ids(END_OF_TURN[family])
    assert tokenizer.stop_ids[0] == tokenizer.eos_id and end_of_turn in tokenizer.stop_ids
    text = tokenizer.decode(encode_prompt(tokenizer, Problem(id="p", prompt="3+4=")))
    assert (
        "user" in text
        and "3+4=" in text
        and text.rstrip().endswith(
            "assistant" if family != "llama" else "assistant<|end_header_id|>"
        )
    )
    # Chat messages (a system turn) go through the template too; without it, the plain prompt.
    messages = ({"role": "system", "content": "add"}, {"role": "user", "content": "3+4="})
    with_system = tokenizer.decode(encode_prompt(tokenizer, Problem(id="p", messages=messages)))
    assert with_system.index("add") < with_system.index("3+4=")
    plain = encode_prompt(tokenizer, Problem(id="p", prompt="3+4="), use_chat_template=False)
    assert tokenizer.decode(plain) == "<bos>3+4="


@pytest.mark.parametrize("family", FAMILIES)
def test_the_sampler_decodes_each_family_with_the_trainers_logprobs(checkpoints, family):
    from marin_rl_core.models.logprobs import response_logprobs
    from marin_rl_core.rollout.inference import SamplingEngine, sample_prompts

    config = ModelConfig(checkpoint=str(checkpoints[family]))
    tokenizer = model_tokenizer(config)
    model = build_model(config, tokenizer, key=jax.random.PRNGKey(0))
    engine = SamplingEngine(model, max_seq_len=32, eos_id=tokenizer.eos_id, max_seqs=8)
    prompt = encode_prompt(tokenizer, Problem(id="p", prompt="3+4="))
    samples = sample_prompts(engine, [prompt], n=4, max_tokens=6, stop_tokens=tokenizer.stop_ids)[0]
    assert all(0 < s.tokens.size <= 6 for s in samples)
    ours = response_logprobs(
        model, [prompt] * 4, [s.tokens for s in samples], max_seq_len=32, pad_id=tokenizer.pad_id
    )
    for sample, logprobs in zip(samples, ours):
        np.testing.assert_allclose(sample.logprobs, logprobs, atol=1e-4)


def test_a_problem_needs_a_prompt_or_messages():
    with pytest.raises(ValueError, match="needs a prompt or chat messages"):
        Problem(id="p")
    with pytest.raises(ValueError, match="role"):
        Problem(id="p", messages=[{"content": "hi"}])


def check_trained_and_exported(source: Path, run_dir: Path, out: Path, family: str) -> None:
    """What a user checks after `marinrl run` and `marinrl export`: prompts went through the
    chat template, the export is the trained model (not the starting one) in its own
    architecture, and its tokenizer, chat template and stop tokens came along."""
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(END_OF_TURN[family] in s["prompt"] for s in samples)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family
    expected_class = type(transformers.AutoConfig.for_model(family)).__name__.replace(
        "Config", "ForCausalLM"
    )
    assert config["architectures"] == [expected_class]

    trained, tokenizer, step = trained_model(run_dir, build_registry())
    assert step == 3
    rows = prompt_rows(source)
    ours = levanter_logits(trained, rows)
    np.testing.assert_allclose(transformers_logits(out, rows), ours, atol=2e-4, rtol=1e-4)
    assert np.abs(transformers_logits(source, rows) - ours).max() > 1e-3, "training changed it"
    again = transformers.AutoTokenizer.from_pretrained(str(out))
    assert again.chat_template == tokenizer.chat_template
    generation = json.loads((out / "generation_config.json").read_text())
    assert again.convert_tokens_to_ids(END_OF_TURN[family]) in generation["eos_token_id"]


def documented_commands(name: str) -> list[list[str]]:
    """The commands of the ```bash block after ``<!-- docs-test: NAME -->`` in hf-models.md."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "hf-models.md").read_text()
    block = (
        text.split(f"<!-- docs-test: {name} -->", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    )
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def guide_run(cli, tmp_path_factory) -> dict[str, Path]:
    """docs/hf-models.md's commands, as written (with the small-job settings appended: later
    --set values win), in a fresh directory: ``my-qwen3`` is a tiny Qwen3 checkpoint saved the
    way transformers 5 saves it (its twin saved by transformers 4, same weights, is ``v4``),
    ``problems.jsonl`` a file task. One run and export for the guide's test and the
    transformers-5 test."""
    import os
    import shutil

    from marin_rl_core.testing import write_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("guide")
    v4 = write_tiny_hf_checkpoint(root / "v4", "qwen3", rope_theta=1e6)
    v5 = write_tiny_hf_checkpoint(root / "v5", "qwen3", rope_theta=1e6, layout="transformers5")
    shutil.copytree(v5, root / "my-qwen3")
    rng = np.random.default_rng(0)
    with open(root / "problems.jsonl", "w") as f:
        for a, b in rng.integers(0, 50, size=(40, 2)):
            f.write(json.dumps({"question": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    commands = documented_commands("train-and-export")
    assert [c[:2] for c in commands] == [["marinrl", "run"], ["marinrl", "export"]]
    cwd = os.getcwd()
    os.chdir(root)  # the guide's relative paths
    try:
        for command in commands:
            result = cli(*command[1:], *(FEW_SMALL_STEPS if command[1] == "run" else []))
            assert result.exit_code == 0, result.output
    finally:
        os.chdir(cwd)
    return {
        "v4": v4, "v5": v5, "run": root / "runs" / "my-first-run",
        "export": root / "my-qwen3-rl", "root": root,
    }  # fmt: skip


def test_the_guide_trains_a_local_checkpoint_on_jsonl_and_exports_it(guide_run):
    """The guide's commands train the checkpoint on the JSONL file and export what trained (the
    starting weights are ``v4``'s, which transformers 4 loads to compare)."""
    check_trained_and_exported(guide_run["v4"], guide_run["run"], guide_run["export"], "qwen3")


def test_a_checkpoint_saved_by_transformers5_trains_and_exports(cli, guide_run):
    """Users save fine-tuned checkpoints with transformers 5 while levanter pins transformers < 5:
    its tokenizer class (``TokenizersBackend``), its template in ``chat_template.jinja`` and its
    ``rope_parameters`` (RoPE theta 1e6, as Qwen3's; read as the default 1e4 it would silently
    change every logit) load as the same checkpoint written by transformers 4 does. The guide's
    run (``guide_run``) trained such a checkpoint and exported it."""
    old, new = guide_run["v4"], guide_run["v5"]
    assert json.loads((new / "tokenizer_config.json").read_text())["tokenizer_class"] == (
        "TokenizersBackend"
    )
    tokenizer = model_tokenizer(ModelConfig(checkpoint=str(new)))
    reference = model_tokenizer(ModelConfig(checkpoint=str(old)))
    assert tokenizer.chat_template == reference.chat_template
    assert tokenizer.stop_ids == reference.stop_ids and len(reference.stop_ids) == 2
    problem = Problem(id="p", prompt="3+4=")
    assert encode_prompt(tokenizer, problem) == encode_prompt(reference, problem)
    model = build_model(ModelConfig(checkpoint=str(new)), tokenizer, key=jax.random.PRNGKey(0))
    rows = prompt_rows(old)
    np.testing.assert_allclose(
        levanter_logits(model, rows), transformers_logits(old, rows), atol=2e-4, rtol=1e-4
    )
    # Trained and exported (by the guide's commands), checked against its transformers-4 twin.
    saved = tomllib.loads((guide_run["run"] / "config.toml").read_text())
    assert Path(saved["model"]["checkpoint"]).name == "my-qwen3"  # the transformers-5 copy
    check_trained_and_exported(old, guide_run["run"], guide_run["export"], "qwen3")
    # A run without LoRA has no adapters to export alone.
    result = cli("export", str(guide_run["run"]), str(guide_run["root"] / "adapter"), "--adapter")
    assert result.exit_code == ExitCode.CONFIG
    assert "trained without LoRA" in result.output and "drop --adapter" in result.output


# About 75 s each here, so with `nox -s slow`; the guide's test above covers Qwen3.
@pytest.mark.slow
@pytest.mark.parametrize(("family", "precision"), [("llama", "bf16"), ("qwen2", "bf16-params")])
def test_train_a_checkpoint_with_marinrl_run_then_export_it(
    cli, checkpoints, family, precision, tmp_path
):
    """Trained with bfloat16 compute (``bf16``: float32 parameters) or bfloat16 parameters
    (``bf16-params``), the export holds the trained parameters in the dtype they were kept in."""
    from safetensors import safe_open

    source = checkpoints[family]
    result = cli(
        "run", "--model", str(source), *SMALL_JOB, "--set", f'trainer.precision="{precision}"',
        "--set", f'run_dir="{tmp_path}"', "--run-id", family,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = tmp_path / f"{family}-export"
    exported = cli("export", str(tmp_path / family), str(out))
    assert exported.exit_code == 0, exported.output
    assert "exported step 3" in exported.output
    check_trained_and_exported(source, tmp_path / family, out, family)
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        dtypes = {weights.get_tensor(name).dtype for name in weights.keys()}
    assert dtypes == {torch.bfloat16 if precision == "bf16-params" else torch.float32}


def test_export_errors_name_the_problem(cli, tmp_path):
    result = cli("export", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert result.exit_code == ExitCode.CONFIG
    assert "nope: no such directory" in result.output
    result = cli("export", str(tmp_path), str(tmp_path / "out"))
    assert result.exit_code == ExitCode.CONFIG
    assert "not a run directory" in result.output


def test_a_tokenizer_that_does_not_fit_the_checkpoint_is_refused(cli, checkpoints, tmp_path):
    qwen3 = str(checkpoints["qwen3"])
    result = cli(
        "run", "--model", qwen3, "--set", 'model.tokenizer="arithmetic"', *SMALL_JOB,
        "--set", f'run_dir="{tmp_path}"',
    )  # fmt: skip
    assert result.exit_code == ExitCode.CONFIG
    assert "has 167 tokens but the model" in result.output and "resize_vocab" in result.output
    assert not list(tmp_path.iterdir()), "nothing is written before the config is valid"
    # Asked for explicitly, the model's vocabulary is resized to the tokenizer.
    resized = build_model(
        ModelConfig(checkpoint=qwen3, tokenizer="arithmetic", resize_vocab=True),
        key=jax.random.PRNGKey(0),
    )
    assert resized.Vocab.size == 167


def test_max_seq_len_beyond_the_checkpoints_context_is_refused(cli, checkpoints, tmp_path):
    result = cli(
        "run", "--model", str(checkpoints["llama"]), *SMALL_JOB,
        "--set", "model.max_seq_len=4096", "--set", f'run_dir="{tmp_path}"',
    )  # fmt: skip
    assert result.exit_code == ExitCode.CONFIG
    assert "context length (max_position_embeddings = 128)" in result.output


def test_a_checkpoints_max_seq_len_is_derived_from_the_lessons_prompts(cli, checkpoints):
    """With no model.max_seq_len, a checkpoint run does not keep the tiny model's 16 positions
    (every chat-templated prompt is longer: nothing would be trained): the value comes from the
    lessons' own prompts and max_tokens, is printed, and lands in the resolved config."""
    import tomllib

    from marin_rl_core.config import lesson_env_config, resolve_config

    qwen3 = str(checkpoints["qwen3"])
    result = cli("config", "show", "--model", qwen3, "--env", "math")
    assert result.exit_code == 0, result.output
    derived = tomllib.loads(result.stdout)["model"]["max_seq_len"]
    assert f"model.max_seq_len = {derived}: derived from the lessons' prompts" in result.output
    registry = build_registry()
    config = resolve_config(
        registry, data={"model": {"checkpoint": qwen3}, "env": {"name": "math"}}
    )
    assert config.model.max_seq_len == derived
    tokenizer = model_tokenizer(config.model)
    for lesson in config.curriculum.lessons:
        name, env_config = lesson_env_config(config, lesson, registry)
        env = registry.get("env", name).build(env_config)
        longest = max(
            len(encode_prompt(tokenizer, p)) for p in env.sample_problems(64, mode="train", seed=7)
        )
        assert longest + config.sampling_for(lesson).max_tokens < derived <= 128
    # Set explicitly (or as "auto"), the user's value wins (or is derived the same way).
    shown = cli(
        "config", "show", "--model", qwen3, "--env", "math", "--set", "model.max_seq_len=40"
    )
    assert tomllib.loads(shown.stdout)["model"]["max_seq_len"] == 40
    assert "derived" not in shown.output
    auto = cli("config", "show", "--model", qwen3, "--set", 'model.max_seq_len="auto"')
    assert tomllib.loads(auto.stdout)["model"]["max_seq_len"] == derived
    # The default model keeps its 16.
    assert tomllib.loads(cli("config", "show").stdout)["model"]["max_seq_len"] == 16


def test_a_missing_checkpoint_or_unreachable_hub_id_says_what_to_do(cli, tmp_path, monkeypatch):
    result = cli("run", "--model", str(tmp_path / "missing"), "--set", f'run_dir="{tmp_path}"')
    assert result.exit_code == ExitCode.CONFIG
    assert "does not exist" in result.output and "hub id" in result.output
    # A checkpoint of another architecture, and one without tokenizer files.
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 100}')
    result = cli("run", "--model", str(tmp_path / "gpt2"), "--set", f'run_dir="{tmp_path}"')
    assert result.exit_code == ExitCode.CONFIG and "'gpt2' checkpoint" in result.output
    assert "llama, qwen2, qwen3" in result.output
    (tmp_path / "qwen3-no-tokenizer").mkdir()
    (tmp_path / "qwen3-no-tokenizer" / "config.json").write_text(
        '{"model_type": "qwen3", "vocab_size": 100}'
    )
    result = cli(
        "run", "--model", str(tmp_path / "qwen3-no-tokenizer"), "--set", f'run_dir="{tmp_path}"'
    )
    assert result.exit_code == ExitCode.CONFIG
    assert "$.model.tokenizer: could not load a Hugging Face tokenizer" in result.output
    (tmp_path / "empty").mkdir()
    result = cli("run", "--model", str(tmp_path / "empty"), "--set", f'run_dir="{tmp_path}"')
    assert result.exit_code == ExitCode.CONFIG and "no config.json" in result.output
    # No network (forced here, so the test is the same everywhere): the error says so.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    result = cli("run", "--model", "marinrl-tests/no-such-model", "--set", f'run_dir="{tmp_path}"')
    assert result.exit_code == ExitCode.CONFIG
    assert "could not fetch" in result.output and "--local-dir" in result.output


def test_a_checkpoint_loads_in_the_samplers_dtype_and_trains_with_gradient_checkpointing(
    checkpoints,
):
    """Rollout workers read a checkpoint straight into their bfloat16 (no float32 copy first);
    the trainer recomputes layer activations in the backward pass (on by default for a
    checkpoint, ``model.gradient_checkpointing``) with the same gradients as without."""
    from marin_rl_core.models.logprobs import next_token_logprobs

    path = str(checkpoints["qwen3"])
    tokenizer = model_tokenizer(ModelConfig(checkpoint=path))
    full = build_model(ModelConfig(checkpoint=path), tokenizer, key=jax.random.PRNGKey(0))
    half = build_model(
        ModelConfig(checkpoint=path), tokenizer, key=jax.random.PRNGKey(0), dtype=jnp.bfloat16
    )
    assert {x.dtype for x in jax.tree.leaves(eqx.filter(half, eqx.is_inexact_array))} == {
        jnp.dtype(jnp.bfloat16)
    }
    for a, b in zip(jax.tree.leaves(cast_floating(full, jnp.bfloat16)), jax.tree.leaves(half)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    off = build_model(
        ModelConfig(checkpoint=path, gradient_checkpointing="off"), tokenizer,
        key=jax.random.PRNGKey(0),
    )  # fmt: skip
    assert full.config.gradient_checkpointing and not off.config.gradient_checkpointing
    ids = hax.named(jnp.asarray(prompt_rows(checkpoints["qwen3"])), ("batch", "position"))

    @eqx.filter_jit
    @eqx.filter_grad
    def grad(model):
        return jnp.sum(next_token_logprobs(model, ids).array)

    for a, b in zip(jax.tree.leaves(grad(full)), jax.tree.leaves(grad(off))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
