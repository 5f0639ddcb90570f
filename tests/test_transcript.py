"""The token-exact record of an agent's calls (``rollout/transcript.py``, the one bookkeeper of
every episode's exact tokens), with a real Hugging Face tokenizer and chat template: calls that
extend each other make one training sample holding exactly the sampled ids and
log-probabilities; an edited history, a template that rewrites the past, and a second choice
each start a sample of their own, counted."""

from __future__ import annotations

import numpy as np
import pytest

from marin_rl_core.rollout.transcript import Transcript, canonical_message
from marin_rl_core.testing import tiny_chat_tokenizer


@pytest.fixture(scope="module")
def hf():
    return tiny_chat_tokenizer("chatml")


def _render(hf):
    return lambda messages, tools: list(
        hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    )


def _sample(hf, text: str, *, stop: bool = True) -> tuple[list[int], list[float], dict]:
    """What the policy would have sampled for ``text`` (ending with <|im_end|>), with made-up
    logprobs, and the assistant message the endpoint returns for it."""
    ids = hf.encode(text, add_special_tokens=False)
    if stop:
        ids = ids + [hf.convert_tokens_to_ids("<|im_end|>")]
    logprobs = [-0.1 * (k + 1) for k in range(len(ids))]
    return ids, logprobs, {"role": "assistant", "content": text}


def _call(transcript, hf, messages, text, *, step=0, stop=True):
    context = transcript.context(messages)
    ids, logprobs, reply = _sample(hf, text, stop=stop)
    transcript.record(context, messages, reply, ids, logprobs, weight_step=step, truncated=not stop)
    return context, ids, logprobs, reply


def test_calls_that_extend_each_other_are_one_sample_of_the_exact_sampled_ids(hf):
    transcript = Transcript(_render(hf))
    first = [{"role": "user", "content": "2+3"}]
    c1, ids1, lp1, reply1 = _call(transcript, hf, first, "5", step=3)
    # The agent sends the reply back as the openai client gives it (extra None fields).
    second = [*first, {**reply1, "tool_calls": None, "refusal": None},
              {"role": "user", "content": "4+4"}]  # fmt: skip
    c2, ids2, lp2, _ = _call(transcript, hf, second, "8", step=4)
    assert c2.parent == 0 and c2.reason is None
    assert c2.ids[: len(c1.ids) + len(ids1)] == c1.ids + ids1, "the recorded ids are reused"

    [rollout] = transcript.rollouts(env_name="e", lesson_id="l", problem_id="p", reward=1.0)
    assert list(rollout.tokens) == c2.ids + ids2
    sampled = np.flatnonzero(rollout.loss_mask)
    starts = [len(c1.ids), len(c2.ids)]
    expected = list(range(starts[0], starts[0] + len(ids1))) + list(
        range(starts[1], starts[1] + len(ids2))
    )
    assert list(sampled) == expected, "the mask is on the sampled tokens only"
    np.testing.assert_allclose(rollout.logprobs[sampled], lp1 + lp2, rtol=1e-6)
    assert list(rollout.turn_starts) == starts and list(rollout.turn_rewards) == [0.0, 1.0]
    assert rollout.reward == 1.0 and rollout.part == 0 and not rollout.truncated
    assert transcript.weight_step(0) == 3 and not transcript.splits


def test_an_edited_history_is_a_flagged_split_not_drift(hf):
    transcript = Transcript(_render(hf))
    first = [{"role": "user", "content": "2+3"}]
    _, ids1, _, reply1 = _call(transcript, hf, first, "5")
    # The agent rewrites what the policy said before asking on.
    edited = [*first, {"role": "assistant", "content": "6"}, {"role": "user", "content": "1+1"}]
    context, ids2, _, _ = _call(transcript, hf, edited, "2")
    assert context.parent is None and context.reason == "fork"
    assert transcript.splits == {"fork": 1}
    parts = transcript.rollouts(env_name="e", lesson_id="l", problem_id="p", reward=0.5)
    assert [r.part for r in parts] == [0, 1]
    # Each sampled id is trained once, in its own sample; the edited "6" is context only.
    assert [int(r.loss_mask.sum()) for r in parts] == [len(ids1), len(ids2)]
    assert list(parts[1].tokens) == context.ids + ids2
    assert list(parts[0].turn_rewards) == [0.0] and list(parts[1].turn_rewards) == [0.5]


def test_a_template_that_rewrites_past_turns_starts_a_new_sample():
    hf = tiny_chat_tokenizer("chatml")
    # Like templates that drop past reasoning: an earlier assistant turn is rendered shortened.
    hf.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'][:1] }}"
        "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    transcript = Transcript(_render(hf))
    first = [{"role": "user", "content": "9+9"}]
    _, _, _, reply = _call(transcript, hf, first, "18")
    context, _, _, _ = _call(transcript, hf, [*first, reply, {"role": "user", "content": "1"}], "1")
    assert context.reason == "template" and transcript.splits == {"template": 1}
    assert len(transcript.rollouts(env_name="e", lesson_id="l", problem_id="p", reward=0)) == 2


def test_each_further_choice_of_a_call_is_a_branch_of_its_own(hf):
    transcript = Transcript(_render(hf))
    first = [{"role": "user", "content": "2+3"}]
    context = transcript.context(first)
    for text in ("5", "6"):  # n=2
        ids, logprobs, reply = _sample(hf, text)
        transcript.record(context, first, reply, ids, logprobs, weight_step=0, truncated=False)
    assert transcript.parts == [[0], [1]] and transcript.splits == {"branch": 1}
    # The agent goes on from the second choice: it continues that choice's sample.
    second = [*first, {"role": "assistant", "content": "6"}, {"role": "user", "content": "1+1"}]
    c2, _, _, _ = _call(transcript, hf, second, "2")
    assert c2.parent == 1 and transcript.parts == [[0], [1, 2]]


def test_a_truncated_call_continued_is_kept_as_sampled(hf):
    """A reply cut at max_tokens has no end-of-turn id; the template adds one after it, which
    still extends the recorded ids: the sample goes on, the cut reply as sampled."""
    transcript = Transcript(_render(hf))
    first = [{"role": "user", "content": "7*7"}]
    c1, ids1, _, reply = _call(transcript, hf, first, "4", stop=False)
    c2, _, _, _ = _call(transcript, hf, [*first, reply, {"role": "user", "content": "?"}], "49")
    assert c2.parent == 0
    [rollout] = transcript.rollouts(env_name="e", lesson_id="l", problem_id="p", reward=0)
    assert list(rollout.tokens[len(c1.ids) : len(c1.ids) + len(ids1)]) == ids1


def test_messages_compare_by_what_the_template_renders():
    plain = {"role": "assistant", "content": "hi"}
    assert canonical_message(plain) == canonical_message(
        {**plain, "refusal": None, "tool_calls": [], "audio": None}
    )
    assert canonical_message({"role": "user", "content": [{"type": "text", "text": "hi"}]}) == (
        canonical_message({"role": "user", "content": "hi"})
    )
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    assert canonical_message({**plain, "tool_calls": [call]}) != canonical_message(plain)
