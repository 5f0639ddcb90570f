"""Tiny Hugging Face checkpoints and chat tokenizers written in code, for tests and benchmarks
(nothing can be downloaded from a model hub here): :func:`tiny_chat_tokenizer` (the arithmetic
tokenizer's vocabulary with a chat template), :func:`write_tiny_hf_checkpoint` (a random tiny
Llama, Qwen2 or Qwen3 saved by ``transformers``) and :func:`as_transformers5_layout`. Re-exported
by :mod:`marin_rl_core.testing`."""

from __future__ import annotations

from typing import Any

CHAT_TEMPLATES = {
    # ChatML, as Qwen2/2.5/3 use it.
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # Llama 3's header/end-of-turn layout.
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
        "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
        "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    # ChatML with tools, as Qwen2.5/Qwen3 (and Hermes) lay them out: the tools' schemas in the
    # system turn, an assistant's calls as <tool_call> blocks of JSON, tool results as
    # <tool_response> blocks in a user turn.
    "chatml_tools": (
        "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}"
        "{{ messages[0]['content'] }}\n\n{% endif %}# tools\n<tools>{% for tool in tools %}\n"
        "{{ tool | tojson }}{% endfor %}\n</tools>\ncall a tool with <tool_call>\n"
        '{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n'
        "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}"
        "<|im_end|>\n{% endif %}"
        "{% for m in messages %}{% if m['role'] == 'system' and loop.first %}"
        "{% elif m['role'] == 'assistant' %}<|im_start|>assistant\n{{ m['content'] or '' }}"
        "{% for c in m['tool_calls'] or [] %}"
        "{% set f = c['function'] if c['function'] is defined else c %}"
        "{% if m['content'] or not loop.first %}\n{% endif %}"
        '<tool_call>\n{"name": "{{ f[\'name\'] }}", "arguments": {{ f[\'arguments\'] | tojson }}}'
        "\n</tool_call>{% endfor %}<|im_end|>\n"
        "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}"
        "\n</tool_response><|im_end|>\n"
        "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
}
_TEMPLATE_OF = {"llama": "llama3", "qwen2": "chatml", "qwen3": "chatml"}

TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
JSON_CHARACTERS = tuple("{}\"_[]#;|'\\")
"""What ``"chatml_tools"`` adds to the arithmetic vocabulary, so that tool schemas and calls are
written without ``<unk>``."""


def tiny_chat_tokenizer(template: str = "chatml") -> Any:
    """A small ``PreTrainedTokenizerFast`` with a chat template, built in code: the arithmetic
    tokenizer's vocabulary plus the template's special tokens and the role words
    (``"chatml_tools"``: also the tool blocks' tags and JSON's punctuation)."""
    from marin_rl_core.models.tokenizer import ArithmeticTokenizer

    hf = ArithmeticTokenizer().to_hf()
    specials = (
        ["<|im_start|>", "<|im_end|>"]
        if template.startswith("chatml")
        else ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    )
    hf.add_special_tokens({"additional_special_tokens": specials})
    hf.add_tokens(["system", "user", "assistant"])
    if template == "chatml_tools":
        hf.add_tokens([*TOOL_TOKENS, *JSON_CHARACTERS])
    hf.chat_template = CHAT_TEMPLATES[template]
    return hf


def write_tiny_hf_checkpoint(
    path: Any,
    model_type: str = "qwen3",
    *,
    seed: int = 0,
    vocab_size: int = 192,
    max_position_embeddings: int = 128,
    hidden_size: int = 32,
    num_layers: int = 2,
    rope_theta: float = 10000.0,
    layout: str = "transformers4",
    dtype: str = "float32",
    template: str | None = None,
    head: str = "lm",
    **config_overrides: Any,
) -> Any:
    """Write a tiny random Hugging Face causal LM checkpoint with ``transformers`` (needs torch):
    ``num_layers`` layers (2), hidden size ``hidden_size`` (32), 4 query and 2 key/value heads, a
    vocabulary of ``vocab_size``
    rows (more than the tokenizer's ~175 tokens, as real checkpoints pad theirs) and
    :func:`tiny_chat_tokenizer` with the family's chat template. Qwen3 ties its embeddings, as
    the small Qwen3 models do. Returns the directory.

    ``model_type``: ``"llama"``, ``"qwen2"`` or ``"qwen3"``. ``layout="transformers5"`` rewrites
    the files the way ``transformers`` 5 saves them (:func:`as_transformers5_layout`), which users'
    fine-tuned checkpoints have while levanter pins ``transformers < 5``. ``dtype`` is the
    saved weights' (``"bfloat16"`` as released checkpoints are); ``config_overrides`` set any
    other field of the ``transformers`` config (``bench/scale.py`` writes Qwen3-0.6B's shape).
    ``template``: the tokenizer's chat template (a key of :data:`CHAT_TEMPLATES`; default the
    family's, ``"chatml_tools"`` for a model that calls tools). ``head="score"`` writes a reward
    model instead: the same body as a ``*ForSequenceClassification`` with one output.
    """
    from pathlib import Path

    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        GenerationConfig,
    )

    path = Path(path)
    template = template or _TEMPLATE_OF[model_type]
    tokenizer = tiny_chat_tokenizer(template)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} < the tokenizer's {len(tokenizer)} tokens")
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=max_position_embeddings,
        # Larger than the usual 0.02 so logits differ visibly between positions and models.
        initializer_range=0.2,
        tie_word_embeddings=model_type == "qwen3",
        rope_theta=rope_theta,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if head not in ("lm", "score"):
        raise ValueError(f"head {head!r}: choose lm (a causal LM) or score (a reward model)")
    if head == "score":
        fields["num_labels"] = 1
    config = AutoConfig.for_model(model_type, **{**fields, **config_overrides})
    torch.manual_seed(seed)
    auto = AutoModelForCausalLM if head == "lm" else AutoModelForSequenceClassification
    model = auto.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    end_of_turn = "<|im_end|>" if template.startswith("chatml") else "<|eot_id|>"
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(end_of_turn)],
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(str(path))
    if layout == "transformers5":
        as_transformers5_layout(path)
    elif layout != "transformers4":
        raise ValueError(f"layout {layout!r}: choose transformers4 or transformers5")
    return path


def as_transformers5_layout(path: Any) -> Any:
    """Rewrite a checkpoint saved by ``transformers`` 4 the way ``transformers`` 5 (checked with
    5.24) saves the same model and tokenizer: ``tokenizer_config.json`` names the class
    ``TokenizersBackend`` (unknown to transformers 4), lists ``extra_special_tokens`` instead of
    ``additional_special_tokens`` and has no ``added_tokens_decoder`` (the added tokens are in
    ``tokenizer.json``); the chat template is in ``chat_template.jinja``; ``config.json`` keeps
    RoPE's settings in ``rope_parameters`` instead of ``rope_theta``/``rope_scaling``. Returns
    the directory."""
    import json
    from pathlib import Path

    path = Path(path)
    tok_file = path / "tokenizer_config.json"
    tok = json.loads(tok_file.read_text())
    template = tok.pop("chat_template", None)
    if isinstance(template, str):
        (path / "chat_template.jinja").write_text(template)
    specials = tok.pop("additional_special_tokens", [])
    for key in ("added_tokens_decoder", "extra_special_tokens", "clean_up_tokenization_spaces"):
        tok.pop(key, None)
    tok.update(
        backend="tokenizers", tokenizer_class="TokenizersBackend", extra_special_tokens=specials
    )
    tok_file.write_text(json.dumps(tok, indent=2))
    (path / "special_tokens_map.json").unlink(missing_ok=True)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    rope = {"rope_theta": config.pop("rope_theta", 10000.0), "rope_type": "default"}
    scaling = config.pop("rope_scaling", None)
    if scaling:
        rope.update(scaling)
    config["rope_parameters"] = rope
    if "torch_dtype" in config:
        config["dtype"] = config.pop("torch_dtype")
    config["transformers_version"] = "5.24.0"
    config_file.write_text(json.dumps(config, indent=2))
    return path
