"""Tokenizers behind one small interface: the arithmetic tokenizer built in code, or a Hugging
Face tokenizer (a checkpoint's own, a local directory or a hub id).

:func:`model_tokenizer` picks the one a run uses: ``model.tokenizer = "auto"`` means the
checkpoint's own tokenizer when ``model.checkpoint`` is set, else the arithmetic one.
:func:`encode_prompt` turns a :class:`~marin_rl_core.types.Problem` into prompt tokens, through
the tokenizer's chat template when it has one.

The arithmetic tokenizer needs no download. Its vocabulary is the specials (``<pad>``, ``<bos>``,
``<eos>``, ``<unk>``), every integer ``0``-``99`` as one token, arithmetic and punctuation
symbols, the space, the lowercase letters and a few whole words the mock env uses. Text is cut
by one regular expression, tried left to right:

* a whole vocabulary word (``count``, ``sort`` ...);
* a number: ``[1-9][0-9]`` or one digit, so ``"7"`` and ``"42"`` are single tokens and longer
  runs split into chunks (``"123"`` -> ``"12"``, ``"3"``; ``"05"`` -> ``"0"``, ``"5"``);
* any other single character, which is a token when it is in the vocabulary and ``<unk>``
  otherwise.

Decoding concatenates the pieces, so ``decode(encode(text)) == text`` for any text made of
vocabulary characters. :meth:`ArithmeticTokenizer.to_hf` builds a ``PreTrainedTokenizerFast``
with the same vocabulary and splitting, for levanter code that needs a Hugging Face tokenizer
(``HFCheckpointConverter`` sizes the vocabulary and fills ``pad/bos/eos_token_id`` from one).

This module imports no JAX; ``transformers`` is imported only when a Hugging Face tokenizer is
built or loaded.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from marin_rl_core.config.schema import ModelConfig
    from marin_rl_core.types import Problem

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
NUMBER_TOKENS: tuple[str, ...] = tuple(str(i) for i in range(100))
SYMBOL_TOKENS: tuple[str, ...] = (
    " ", "+", "-", "*", "/", "=", "(", ")", ",", ".", "?", ":", "<", ">", "!", "\n",
)  # fmt: skip
LETTER_TOKENS: tuple[str, ...] = tuple("abcdefghijklmnopqrstuvwxyz")
WORD_TOKENS: tuple[str, ...] = (
    # task verbs of the mock env, and a few words its problems are made of
    "count", "sort", "reverse", "copy", "max", "min", "sum", "what", "is", "the", "answer",
    "cat", "dog", "fox", "owl", "bee", "ant", "cow", "pig", "hen", "yak",
)  # fmt: skip

ARITHMETIC_VOCAB: tuple[str, ...] = (
    SPECIAL_TOKENS + NUMBER_TOKENS + SYMBOL_TOKENS + LETTER_TOKENS + WORD_TOKENS
)
"""Every token of the arithmetic tokenizer, in id order (``<pad>`` is 0, the number ``n`` is
``n + 4``)."""

# Longest words first so that a word is never cut short by a shorter one it starts with.
_WORD_ALTERNATIVES = "|".join(sorted(WORD_TOKENS, key=lambda w: (-len(w), w)))
SPLIT_PATTERN = rf"(?:{_WORD_ALTERNATIVES})|[1-9][0-9]|[0-9]|[\s\S]"
"""The regular expression that cuts text into pieces (shared with the Hugging Face version)."""


@runtime_checkable
class Tokenizer(Protocol):
    """What marinrl needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """The number of token ids (the model's vocabulary axis size)."""
        ...

    @property
    def pad_id(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a response: EOS first, then the chat template's end-of-turn token(s)
        and the checkpoint's ``generation_config.json`` EOS ids."""
        ...

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template, or ``None`` for a tokenizer without one."""
        ...

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of ``text``, with the BOS id in front when ``add_bos`` (and one exists)."""
        ...

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Any] | None = None
    ) -> list[int]:
        """Token ids of ``messages`` through the chat template, ending with the prompt that
        opens the assistant's turn; ``tools`` (OpenAI-style function schemas) are rendered
        where the template shows them. Only for tokenizers with a chat template."""
        ...

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``. Special tokens are kept (``"7<pad>"``) unless
        ``skip_special_tokens``: a policy must not pass off a response that goes on after its
        answer as that answer; callers strip the stop tokens themselves."""
        ...

    def to_hf(self) -> Any:
        """A ``transformers.PreTrainedTokenizerBase`` with the same vocabulary."""
        ...


class ArithmeticTokenizer:
    """The tokenizer built in code (see the module docstring). Stateless and picklable."""

    def __init__(self) -> None:
        self._id_of = {token: i for i, token in enumerate(ARITHMETIC_VOCAB)}
        if len(self._id_of) != len(ARITHMETIC_VOCAB):
            raise AssertionError("the arithmetic vocabulary has a duplicate token")
        self._split = re.compile(SPLIT_PATTERN)
        self._special_ids = frozenset(self._id_of[t] for t in (PAD, BOS, EOS))

    @property
    def vocab(self) -> tuple[str, ...]:
        return ARITHMETIC_VOCAB

    @property
    def vocab_size(self) -> int:
        return len(ARITHMETIC_VOCAB)

    @property
    def pad_id(self) -> int:
        return self._id_of[PAD]

    @property
    def bos_id(self) -> int:
        return self._id_of[BOS]

    @property
    def eos_id(self) -> int:
        return self._id_of[EOS]

    @property
    def unk_id(self) -> int:
        return self._id_of[UNK]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    @property
    def chat_template(self) -> None:
        return None

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Any] | None = None
    ) -> list[int]:
        raise ValueError("the arithmetic tokenizer has no chat template; give Problem.prompt")

    def token_id(self, token: str) -> int:
        """The id of one vocabulary entry (``token_id("7")``, ``token_id("+")``)."""
        try:
            return self._id_of[token]
        except KeyError:
            raise KeyError(f"{token!r} is not in the arithmetic vocabulary") from None

    def tokenize(self, text: str) -> list[str]:
        """The pieces ``text`` is cut into (before mapping to ids)."""
        return self._split.findall(text)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = [self._id_of.get(piece, self.unk_id) for piece in self._split.findall(text)]
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        pieces = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(ARITHMETIC_VOCAB):
                raise ValueError(
                    f"token id {i} is outside the vocabulary (0..{self.vocab_size - 1})"
                )
            if skip_special_tokens and i in self._special_ids:
                continue
            pieces.append(ARITHMETIC_VOCAB[i])
        return "".join(pieces)

    def to_hf(self) -> Any:
        """A ``PreTrainedTokenizerFast`` that encodes and decodes exactly like this one.

        ``tokenizer(text)`` adds ``<bos>`` in front (``add_special_tokens=False`` does not).
        """
        from tokenizers import Regex, decoders, pre_tokenizers, processors
        from tokenizers import Tokenizer as RawTokenizer
        from tokenizers.models import WordLevel
        from transformers import PreTrainedTokenizerFast

        raw = RawTokenizer(WordLevel(vocab=dict(self._id_of), unk_token=UNK))
        raw.pre_tokenizer = pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated")
        raw.decoder = decoders.Fuse()
        raw.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, self.bos_id)]
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=raw,
            pad_token=PAD,
            bos_token=BOS,
            eos_token=EOS,
            unk_token=UNK,
            clean_up_tokenization_spaces=False,
            model_max_length=4096,
        )

    def __repr__(self) -> str:
        return f"ArithmeticTokenizer(vocab_size={self.vocab_size})"


# End-of-turn markers of common chat templates: a response ends at one of these as well as at EOS.
END_OF_TURN_TOKENS: tuple[str, ...] = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|eom_id|>",
)


class HFTokenizer:
    """A Hugging Face tokenizer behind :class:`Tokenizer`.

    A tokenizer without a pad token uses its EOS token for padding (padding is always masked
    out of the loss, so which id fills it does not matter).

    Args:
        hf_tokenizer: a ``transformers.PreTrainedTokenizerBase``.
        extra_stop_ids: more ids that end a response (a checkpoint's
            ``generation_config.json`` EOS ids).
    """

    def __init__(self, hf_tokenizer: Any, *, extra_stop_ids: Iterable[int] = ()):
        self._hf = hf_tokenizer
        if hf_tokenizer.eos_token_id is None:
            raise ValueError(
                f"the tokenizer {getattr(hf_tokenizer, 'name_or_path', '')!r} has no EOS token; "
                "marinrl needs one to end responses. Set `eos_token` in its tokenizer_config.json."
            )
        stops = [int(hf_tokenizer.eos_token_id), *map(int, extra_stop_ids)]
        template = self.chat_template or ""
        vocab = hf_tokenizer.get_vocab()
        stops += [vocab[t] for t in END_OF_TURN_TOKENS if t in template and t in vocab]
        self._stop_ids = tuple(dict.fromkeys(stops))

    @property
    def vocab_size(self) -> int:
        return len(self._hf)

    @property
    def pad_id(self) -> int:
        pad = self._hf.pad_token_id
        return int(pad) if pad is not None else int(self._hf.eos_token_id)

    @property
    def bos_id(self) -> int | None:
        bos = self._hf.bos_token_id
        return int(bos) if bos is not None else None

    @property
    def eos_id(self) -> int:
        return int(self._hf.eos_token_id)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    @property
    def chat_template(self) -> str | None:
        template = getattr(self._hf, "chat_template", None)
        return template if isinstance(template, str) and template else None

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(self._hf.encode(text, add_special_tokens=False))
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Any] | None = None
    ) -> list[int]:
        if self.chat_template is None:
            raise ValueError(
                f"the tokenizer {getattr(self._hf, 'name_or_path', '')!r} has no chat template; "
                "give Problem.prompt, or a tokenizer with a chat template"
            )
        # Render to text and encode without added specials: the template writes its own BOS.
        text = self._hf.apply_chat_template(
            [dict(m) for m in messages],
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=True,
        )
        return list(self._hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def to_hf(self) -> Any:
        return self._hf

    def __repr__(self) -> str:
        return (
            f"HFTokenizer({getattr(self._hf, 'name_or_path', '')!r}, vocab_size={self.vocab_size})"
        )


def _generation_eos_ids(path: Path) -> list[int]:
    """The EOS id(s) of a checkpoint's ``generation_config.json`` (an int or a list)."""
    import json

    try:
        eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return []
    if isinstance(eos, int):
        return [eos]
    return [int(e) for e in eos if isinstance(e, int)] if isinstance(eos, list) else []


TRANSFORMERS5_TOKENIZER_CLASSES = ("TokenizersBackend",)
"""``tokenizer_class`` names that ``transformers`` 5 writes and ``transformers`` 4 does not know."""


def _load_hf_tokenizer(path: Path) -> Any:
    """``AutoTokenizer.from_pretrained`` of a local directory, also for a tokenizer saved by
    ``transformers`` 5 (class ``TokenizersBackend``, ``extra_special_tokens`` as a list, the
    chat template in ``chat_template.jinja``): its ``tokenizer.json`` is read as a
    ``PreTrainedTokenizerFast``, with the same vocabulary, special tokens and template."""
    import json
    import logging

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if config.get("tokenizer_class") not in TRANSFORMERS5_TOKENIZER_CLASSES:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    kwargs: dict[str, Any] = {}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, list):  # transformers 4 wants a {name: token} mapping there
        kwargs.update(extra_special_tokens={}, additional_special_tokens=extra)
    # transformers warns that the class differs from the one the config names: intended here.
    quiet = logging.getLogger("transformers.tokenization_utils_base")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True, **kwargs)
    finally:
        quiet.setLevel(level)


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer ``spec`` names.

    Args:
        spec: ``"arithmetic"`` for :class:`ArithmeticTokenizer`; the path of a local Hugging Face
            tokenizer directory (one with ``tokenizer.json`` or ``tokenizer_config.json``, e.g. a
            checkpoint directory); or a hub id (``Qwen/Qwen3-0.6B``), fetched into the Hugging
            Face cache.

    Raises:
        ValueError: for a path that does not exist or holds no tokenizer.
        marin_rl_core.models.pretrained.CheckpointNotFoundError: a hub id that cannot be fetched.
    """
    from marin_rl_core.models.pretrained import checkpoint_dir, is_hub_id

    if spec == "arithmetic":
        return ArithmeticTokenizer()
    if spec == "auto":
        raise ValueError(
            'tokenizer "auto" depends on the model: use model_tokenizer(config.model) to load it'
        )
    path = Path(spec).expanduser()
    if not path.is_dir():
        if not is_hub_id(spec):
            raise ValueError(
                f"tokenizer {spec!r} is neither 'arithmetic', 'auto', a local directory nor a "
                'hub id. Use model.tokenizer = "auto" (the checkpoint\'s own), "arithmetic", '
                "or the path of a Hugging Face tokenizer directory."
            )
        path = checkpoint_dir(spec)
    try:
        hf = _load_hf_tokenizer(path)
    except Exception as exc:  # transformers raises OSError, ValueError, TypeError ... here
        raise ValueError(
            f"could not load a Hugging Face tokenizer from {str(path)!r} ({type(exc).__name__}: "
            f"{exc}); the directory needs tokenizer.json or tokenizer_config.json with its "
            "vocabulary files"
        ) from exc
    return HFTokenizer(hf, extra_stop_ids=_generation_eos_ids(path))


def model_tokenizer(config: ModelConfig) -> Tokenizer:
    """The tokenizer a run uses: ``config.tokenizer``, where ``"auto"`` means the checkpoint's
    own tokenizer (``model.checkpoint`` set) or the arithmetic tokenizer (the embedded default
    model)."""
    if config.tokenizer != "auto":
        return load_tokenizer(config.tokenizer)
    if not config.checkpoint:
        return ArithmeticTokenizer()
    from marin_rl_core.models.pretrained import checkpoint_dir

    return load_tokenizer(str(checkpoint_dir(config.checkpoint)))


def response_stop_ids(tokenizer: Tokenizer, lesson_stops: Iterable[int] = ()) -> tuple[int, ...]:
    """Every id that ends a sampled response, EOS first: the tokenizer's :attr:`Tokenizer.stop_ids`
    (EOS, the chat template's end of turn, a checkpoint's ``generation_config.json`` EOS ids)
    and a lesson's own ``sampling.stop_tokens``.

    The one source of truth for stop ids: every sampler call (training, eval, multi-turn
    episodes) and the engine's capacity (``max_stop_tokens``) come from it. A Qwen model whose
    EOS is ``<|endoftext|>`` must still stop at ``<|im_end|>``: a response that runs past the end
    of its turn is graded on text the model invented after it.
    """
    return tuple(dict.fromkeys([*map(int, tokenizer.stop_ids), *map(int, lesson_stops)]))


def encode_prompt(
    tokenizer: Tokenizer, problem: Problem, *, use_chat_template: bool = True
) -> list[int]:
    """The prompt tokens of ``problem``.

    With a chat template (and ``use_chat_template``), ``problem.messages`` (or, for a plain
    prompt, one user message holding ``problem.prompt``) go through it, ending with the opening
    of the assistant's turn. Otherwise ``problem.prompt`` is encoded with BOS in front.

    Raises:
        ValueError: a problem with only chat messages for a tokenizer without a chat template.
    """
    if use_chat_template and tokenizer.chat_template is not None:
        messages = problem.messages or ({"role": "user", "content": problem.prompt},)
        return tokenizer.encode_chat(messages)
    if not problem.prompt:
        raise ValueError(
            f"problem {problem.id!r} has chat messages but no prompt, and the tokenizer "
            f"{tokenizer!r} has no chat template (or model.use_chat_template is false); give "
            "Problem.prompt as well"
        )
    return tokenizer.encode(problem.prompt, add_bos=True)


__all__ = [
    "ARITHMETIC_VOCAB",
    "ArithmeticTokenizer",
    "END_OF_TURN_TOKENS",
    "HFTokenizer",
    "SPLIT_PATTERN",
    "Tokenizer",
    "encode_prompt",
    "load_tokenizer",
    "model_tokenizer",
    "response_stop_ids",
]
