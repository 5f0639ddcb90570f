"""A tool-calling agent through the endpoint (issue 30) with a model that calls tools: a tiny Qwen3
taught one calculator conversation with ``transformers`` (supervised, in a few seconds), then
served as the policy. The real ``openai`` client gets the call as ``tool_calls`` (streamed and
not), runs the tool, sends the result back, and the episode is one training sample of the exact
sampled ids."""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest
from test_agent_endpoint import _trainer_agrees
from test_episodes import _manager

from marin_rl_core import (
    EnvPlugin,
    LessonConfig,
    Problem,
    SamplingParams,
    Score,
    hookimpl,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "parameters": {"type": "object", "properties": {"e": {"type": "string"}}},
        },
    }
]
QUESTION = [{"role": "user", "content": "what is 2*3?"}]
CALL = '<tool_call>\n{"name": "calc", "arguments": {"e": "2*3"}}\n</tool_call>'
ANSWER = "the answer is 6"


def calculator_agent(client, model: str, question: list[dict], *, stream: bool) -> str:
    """A plain OpenAI-client tool loop: ask, run the tools the model calls, ask again."""
    messages = list(question)
    for _ in range(4):
        if stream:  # accumulate the streamed message, tool calls included
            content, calls, finish = "", {}, None
            for chunk in client.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, temperature=0, stream=True
            ):
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for call in delta.tool_calls or []:
                    calls[call.index] = call
                finish = chunk.choices[0].finish_reason or finish
            message = {"role": "assistant", "content": content or None}
            if calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": c.function.model_dump()}
                    for c in calls.values()
                ]
        else:
            choice = client.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, temperature=0
            ).choices[0]
            message, finish = choice.message, choice.finish_reason
        messages.append(message)
        tool_calls = message.get("tool_calls") if isinstance(message, dict) else message.tool_calls
        if finish != "tool_calls":
            return message["content"] if isinstance(message, dict) else message.content
        for call in tool_calls:
            function = call["function"] if isinstance(call, dict) else call.function
            arguments = function["arguments"] if isinstance(function, dict) else function.arguments
            expression = json.loads(arguments)["e"]
            result = str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - "2*3", our own
            call_id = call["id"] if isinstance(call, dict) else call.id
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return ""


@attrs.frozen
class ToolAgentConfig:
    stream: bool = False


class ToolAgentEnv:
    def __init__(self, config: ToolAgentConfig):
        self.config = config

    def sample_problems(self, n, *, mode, seed):
        return [Problem(id=f"q{i}", prompt="what is 2*3?", answer="6") for i in range(n)]

    def run_agent(self, problem, endpoint):
        import openai

        client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
        return calculator_agent(client, endpoint.model, QUESTION, stream=self.config.stream)

    def score(self, problem, result):
        return Score(float(result.strip().endswith(problem.answer)), {"answered": 1.0})


class tool_plugin:
    @staticmethod
    @hookimpl
    def marinrl_register_envs():
        yield EnvPlugin(
            name="tool_agent",
            summary="test",
            config_class=ToolAgentConfig,
            build=ToolAgentEnv,
            default_lessons=lambda config: [
                LessonConfig(
                    id="tools",
                    env="tool_agent",
                    sampling=SamplingParams(temperature=0.0, max_tokens=48, n_prompts=2),
                    eval_sampling=SamplingParams(temperature=0.0, max_tokens=48, n_prompts=2),
                )
            ],
        )


def _teach(path) -> None:
    """Teach the checkpoint the calculator conversation (loss on the assistant's turns only)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marin_rl_core.rollout.agent_api import template_messages

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    render = lambda messages: tokenizer.apply_chat_template(
        template_messages(messages), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    call = {"name": "calc", "arguments": '{"e": "2*3"}'}
    first = render(QUESTION)
    second = render(
        [
            *QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "function": call}]},
            {"role": "tool", "tool_call_id": "a", "content": "6"},
        ]
    )
    assert second.startswith(first + CALL + "<|im_end|>")
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
    ids = encode(second + ANSWER + "<|im_end|>")
    labels = list(ids)
    taught = [(len(encode(first)), len(encode(first + CALL + "<|im_end|>")))]
    taught.append((len(encode(second)), len(ids)))
    masked = [-100] * len(ids)
    for start, end in taught:
        masked[start:end] = labels[start:end]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    inputs, targets = torch.tensor([ids]), torch.tensor([masked])
    for _ in range(400):
        loss = model(inputs, labels=targets).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if loss.item() < 1e-3:
            break
    model.save_pretrained(str(path), safe_serialization=True)


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    pytest.importorskip("torch")
    from marin_rl_core.testing import tiny_chat_tokenizer, write_tiny_hf_checkpoint

    path = tmp_path_factory.mktemp("tools") / "qwen3"
    write_tiny_hf_checkpoint(
        path, "qwen3", template="chatml_tools", hidden_size=64,
        vocab_size=len(tiny_chat_tokenizer("chatml_tools")), max_position_embeddings=384,
    )  # fmt: skip
    _teach(path)
    return path


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_calling_agent_gets_tool_calls_and_its_episode_is_one_exact_sample(taught, stream):
    manager, config = _manager(
        "tool_agent",
        modules=[tool_plugin],
        overrides=[
            f'model.checkpoint="{taught}"',
            "model.max_seq_len=320",
            'model.inference_dtype="float32"',
            f"env.stream={str(stream).lower()}",
        ],
    )
    try:
        batch, metrics = manager.sample_batch(
            "tools", n_examples=2, n_generations=2, mode="train", seed=0, weight_step=3,
            worker_id="w",
        )  # fmt: skip
        assert metrics["env_errors"] == 0
        # The model called the tool, got its result, and answered: every episode scores 1.
        assert metrics["reward"] == 1.0 and metrics["turns"] == 2.0
        # Both calls of each episode are one training sample: the template renders the
        # returned tool call back to the very ids sampled, so nothing is split or re-tokenized.
        assert metrics["episode_splits"] == 0 and len(batch.rollouts) == 4
        tokenizer = manager.tokenizer
        for r in batch.rollouts:
            assert r.part == 0 and r.num_turns == 2 and not r.truncated
            starts = r.turn_starts.tolist()
            sampled = [tokenizer.decode(r.tokens[s : _masked_end(r, s)].tolist()) for s in starts]
            assert sampled[0] == CALL + "<|im_end|>" and sampled[1] == ANSWER + "<|im_end|>"
            between = tokenizer.decode(r.tokens[starts[0] : starts[1]].tolist())
            assert "<tool_response>\n6\n</tool_response>" in between
            assert np.all(r.logprobs[~r.loss_mask] == 0)
        _trainer_agrees(manager, config, batch.rollouts, temperature=1.0)
    finally:
        manager.shutdown()


def _masked_end(r, start: int) -> int:
    end = start
    while end < r.num_tokens and r.loss_mask[end]:
        end += 1
    return end
