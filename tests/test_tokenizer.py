"""The arithmetic tokenizer and the local Hugging Face tokenizer loader."""

from __future__ import annotations

import pytest

from marin_rl_core.models.tokenizer import (
    ArithmeticTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)

TEXTS = [
    "3+4=",
    "12+34=46",
    "99*99=9801",
    "count: cat dog cat",
    "sort: 5 2 9",
    "what is (7-2)*3? 15.",
    "123 05 100",
    "",
]


@pytest.fixture(scope="module")
def tok() -> ArithmeticTokenizer:
    return ArithmeticTokenizer()


def test_every_number_below_100_is_one_token(tok):
    for n in range(100):
        ids = tok.encode(str(n))
        assert len(ids) == 1, n
        assert tok.decode(ids) == str(n)
    assert len({tok.encode(str(n))[0] for n in range(100)}) == 100


def test_arithmetic_prompt_is_one_token_per_symbol(tok):
    assert tok.tokenize("13+5=18") == ["13", "+", "5", "=", "18"]
    assert tok.encode("3+4=", add_bos=True) == [tok.bos_id, *tok.encode("3+4=")]
    # Longer digit runs split into number tokens and still round-trip.
    assert tok.tokenize("123") == ["12", "3"]
    assert tok.tokenize("05") == ["0", "5"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_inverts_encode(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_mock_env_words_are_whole_tokens(tok):
    assert tok.tokenize("count: cat dog") == ["count", ":", " ", "cat", " ", "dog"]
    # A word outside the vocabulary falls back to letters.
    assert tok.tokenize("zebra") == list("zebra")


def test_unknown_characters_become_unk(tok):
    ids = tok.encode("Hi é")
    assert ids.count(tok.unk_id) == 2
    assert tok.decode(ids) == "<unk>i <unk>"


def test_special_tokens_are_distinct_and_visible_unless_skipped(tok):
    assert len({tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id}) == 4
    ids = [tok.bos_id, *tok.encode("7"), tok.pad_id, tok.eos_id]
    # A response that goes on after its answer must not decode to just the answer.
    assert tok.decode(ids) == "<bos>7<pad><eos>"
    assert tok.decode(ids, skip_special_tokens=True) == "7"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_hf_version_encodes_and_decodes_identically(tok):
    hf = tok.to_hf()
    assert len(hf) == tok.vocab_size
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (
        tok.pad_id,
        tok.bos_id,
        tok.eos_id,
    )
    for text in TEXTS + ["Hi é", "zebra"]:
        ids = tok.encode(text)
        assert hf(text, add_special_tokens=False)["input_ids"] == ids, text
        assert hf(text)["input_ids"] == [tok.bos_id, *ids]
        assert hf.decode(ids) == tok.decode(ids)


def test_load_tokenizer_arithmetic_and_local_directory(tok, tmp_path):
    assert isinstance(load_tokenizer("arithmetic"), ArithmeticTokenizer)
    tok.to_hf().save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert isinstance(loaded, HFTokenizer)
    assert isinstance(loaded, Tokenizer)
    assert loaded.vocab_size == tok.vocab_size
    assert (loaded.pad_id, loaded.bos_id, loaded.eos_id) == (tok.pad_id, tok.bos_id, tok.eos_id)
    for text in TEXTS:
        assert loaded.encode(text, add_bos=True) == tok.encode(text, add_bos=True)
        assert loaded.decode(tok.encode(text)) == text


def test_load_tokenizer_rejects_what_it_cannot_load(tmp_path):
    with pytest.raises(
        ValueError, match="neither 'arithmetic', 'auto', a local directory nor a hub id"
    ):
        load_tokenizer("gpt2")
    with pytest.raises(ValueError, match="could not load a Hugging Face tokenizer"):
        load_tokenizer(str(tmp_path))
