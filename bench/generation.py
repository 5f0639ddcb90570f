"""Generated tokens per second of every generation engine on the same requests, side by side.

A model with Qwen3-0.6B's shape (hidden 1024, 16 query and 8 key/value heads of 128, MLP 3072,
its 151,936-token vocabulary, tied embeddings; ``--layers`` of its 28 layers, random weights) is
built once; each engine samples the same prompts (``rows`` distinct prompts of 32-96 random
tokens, one sample each, temperature 1) to ``new tokens`` each. A warm-up call compiles first;
the table shows the median of ``--repeats`` timed calls, each engine's ratio to the paged engine
(levanter's ``InferenceEngine``), to the plain JAX loop of ``bench/plain_generation.py`` (a
KV cache, the whole generation in one jit: what a user would write instead of an engine; its
greedy tokens are first checked against the ``kv`` engine's, in float32: bfloat16's rounding parts
greedy paths early) and, where ``torch`` and
``transformers`` import and a GPU is present, to transformers' ``generate`` (eager, sdpa, a
random model of the same shape).

    python bench/generation.py                      # CPU: 2 layers, 8 rows x 32, kv and paged
    python bench/generation.py --rows 32 --tokens 128 --repeats 3  # CPU: issue 48's cell (minutes)
    python bench/generation.py --layers 28 --rows 32 64 256 --tokens 128 512 \
        --engines kv paged dense \
        --limit paged=8192 --limit dense=8192 --limit plain=4096  # a GPU (bench/device/all.sh)

The default run takes under a minute and a half on a 2-core CPU, kv and paged done in 54 s
(2026-12-07, an AMD EPYC machine; the paged engine's call costs about the same at any token
count, levanter's engine running a fixed number of rounds, 11-16 s at 8 rows and 24 s at 32). ``dense`` runs only when named: it
recomputes the whole sequence for every token (tens of minutes at 32 x 128 on a CPU). Cells run
kv and paged at the first rows x tokens first (the last line's ratio), then every row count at
the first token count (the bars' cells); ``--limit NAME=N`` skips an engine (or ``plain``,
``transformers``) where rows x tokens exceeds N. The cells are measured in a child process
(bench/cells.py): a time limit (``timeout``'s SIGTERM) or Ctrl-C stops it at once, mid-cell too,
and the table of what finished is still printed.

The last line is ``speed-up over paged: N.NNx``: the ``kv`` engine against the paged engine at
the first row count and token count given (8 x 32 by default).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

QWEN3_0_6B = dict(
    vocab=151_936, hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=128, theta=1e6
)


def build_model(layers: int, dtype: str, seq_len: int):  # type: ignore[no-untyped-def]
    import haliax as hax
    import jax
    import jax.numpy as jnp
    from levanter.layers.rotary import DefaultRotaryEmbeddingsConfig
    from levanter.models.qwen import Qwen3Config

    from marin_rl_core.models.build import cast_floating

    config = Qwen3Config(
        seq_len=seq_len,
        hidden_dim=QWEN3_0_6B["hidden"],
        intermediate_dim=QWEN3_0_6B["intermediate"],
        num_layers=layers,
        num_heads=QWEN3_0_6B["heads"],
        num_kv_heads=QWEN3_0_6B["kv_heads"],
        head_dim=QWEN3_0_6B["head_dim"],
        tie_word_embeddings=True,
        layer_norm_epsilon=1e-6,
        rope=DefaultRotaryEmbeddingsConfig(theta=QWEN3_0_6B["theta"]),
        gradient_checkpointing=False,
    )
    vocab = hax.Axis("vocab", QWEN3_0_6B["vocab"])
    init = jax.jit(lambda key: config.model_type.init(vocab, config, key=key))
    model = init(jax.random.PRNGKey(0))
    return cast_floating(model, jnp.dtype(dtype)), config


def prompts_for(rows: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        rng.integers(1, QWEN3_0_6B["vocab"] - 2, size=int(rng.integers(32, 97))).tolist()
        for _ in range(rows)
    ]


@functools.cache
def compile_counter() -> list[int]:
    """A one-element count of this process's XLA compilations (jax.monitoring), listening from
    the first call on: it tells a timed call that compiled from one that did not."""
    from jax._src import monitoring

    count = [0]

    def listen(event: str, duration: float, **kwargs: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            count[0] += 1

    monitoring.register_event_duration_secs_listener(listen)
    return count


def time_engine(engine, prompts, tokens: int, repeats: int, seed: int) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """(median seconds, tokens generated) of ``engine.generate`` on ``prompts``, compiled first.

    The warm-up generates a few tokens only (a full one costs the kv engine a whole timed call;
    levanter's paged engine takes as long at any length); a timed call that still compiled
    something (an attention window the warm-up did not reach) is not counted, and is timed
    again."""
    from marin_rl_core.rollout.inference import sample_prompts

    compiles = compile_counter()

    def call(max_tokens: int, seed: int) -> tuple[float, int, int]:
        before, start = compiles[0], time.perf_counter()
        out = sample_prompts(
            engine, prompts, n=1, temperature=1.0, max_tokens=max_tokens, seed=seed
        )
        seconds = time.perf_counter() - start
        return seconds, sum(int(s.tokens.size) for g in out for s in g), compiles[0] - before

    call(min(tokens, 4), seed + 1000)  # compile
    times, generated, retimed = [], 0, 0
    while len(times) < repeats:
        seconds, generated, compiled = call(tokens, seed + len(times) + retimed)
        if compiled and retimed < 2:
            retimed += 1
            continue
        times.append(seconds)
    return statistics.median(times), generated


def time_transformers(layers: int, prompts, tokens: int, repeats: int) -> tuple[float, int] | None:  # type: ignore[no-untyped-def]
    """transformers' ``generate`` on a random model of the same shape (GPU only), or None."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    config = transformers.Qwen3Config(
        vocab_size=QWEN3_0_6B["vocab"],
        hidden_size=QWEN3_0_6B["hidden"],
        intermediate_size=QWEN3_0_6B["intermediate"],
        num_hidden_layers=layers,
        num_attention_heads=QWEN3_0_6B["heads"],
        num_key_value_heads=QWEN3_0_6B["kv_heads"],
        head_dim=QWEN3_0_6B["head_dim"],
        rope_theta=QWEN3_0_6B["theta"],
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model = model.cuda().eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left-padded, as generate wants
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.cuda(), mask.cuda()

    def run() -> int:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                pad_token_id=0,
            )
        torch.cuda.synchronize()
        return int((out.shape[1] - width) * out.shape[0])

    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        generated = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), generated


def engine_spec(model, seq_len: int, rows: int, dtype: str, platform: str):  # type: ignore[no-untyped-def]
    from marin_rl_core import EngineSpec

    return EngineSpec(
        model=model,
        max_seq_len=seq_len,
        eos_id=QWEN3_0_6B["vocab"] - 1,
        max_seqs=rows,
        compute_dtype=dtype,
        platform=platform,
    )


def limit(text: str) -> tuple[str, int]:
    """``NAME=N`` of ``--limit``."""
    name, _, n = text.partition("=")
    if not name or not n.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=N, e.g. paged=8192")
    return name, int(n)


def check_plain(registry, model, seq_len: int, dtype: str, platform: str, kind: str) -> None:  # type: ignore[no-untyped-def]
    """Print how many of the plain JAX loop's greedy tokens equal ``kind``'s on a few prompts:
    the reference must generate what the model generates, not just generate fast."""
    import plain_generation

    prompts = prompts_for(4, seed=1)
    engine = registry.build_engine(
        kind, engine_spec(model, seq_len, len(prompts), dtype, platform), None
    )
    equal, compared = plain_generation.greedy_agrees(model, engine, prompts, 8, seq_len=seq_len)
    print(f"plain JAX loop's greedy tokens equal to {kind}'s: {equal} of {compared}", flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="of Qwen3-0.6B's 28 layers")
    parser.add_argument("--rows", type=int, nargs="+", default=[8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32])
    parser.add_argument(
        "--engines",
        nargs="+",
        default=["kv", "paged"],
        help="engine plugin names (dense, which recomputes every position for every token, "
        "only when named: on a CPU it takes tens of minutes at 32 x 128)",
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on an accelerator")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain JAX loop")
    parser.add_argument(
        "--limit",
        action="append",
        type=limit,
        default=[],
        metavar="NAME=N",
        help="run NAME (an engine, 'plain' or 'transformers') only where rows x tokens is at most "
        "N; on a GPU the paged engine makes ~200 tok/s (256 x 512 alone would take ten "
        "minutes), dense recomputes the whole sequence every token, plain compiles per cell",
    )
    return parser.parse_args()


def cell_order(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """``(name, rows, tokens)`` in the order they are measured: the last line's two cells (kv and
    paged at the first rows x tokens) first, so a short time limit still gets the ratio; then
    every row count at the first token count (the bars' cells), the other token counts after."""
    order: list[tuple[str, int, int]] = []
    first = (args.rows[0], args.tokens[0])
    for kind in ("kv", "paged"):
        if kind in args.engines:
            order.append((kind, *first))
    for tokens in args.tokens:
        for rows in args.rows:
            for kind in args.engines:
                order.append((kind, rows, tokens))
            if not args.no_plain:
                order.append(("plain JAX", rows, tokens))
            if not args.no_transformers:
                order.append(("transformers", rows, tokens))
    return list(dict.fromkeys(order))


def measure(args: argparse.Namespace) -> None:
    """The measuring child (bench/cells.py): every cell in :func:`cell_order`, each reported as
    it finishes."""
    import cells
    import jax

    if jax.devices()[0].platform == "cpu":
        # transformers' generate runs on a GPU only; without torch, levanter's import (through
        # transformers) takes half the time.
        os.environ.setdefault("USE_TORCH", "0")
    import plain_generation

    from marin_rl_core import build_registry

    registry = build_registry()

    platform = jax.devices()[0].platform
    dtype = args.dtype if args.dtype != "auto" else ("float32" if platform == "cpu" else "bfloat16")
    seq_len = 96 + max(args.tokens)
    seq_len = -(-seq_len // 16) * 16
    model, _ = build_model(args.layers, dtype, seq_len)
    print(
        f"Qwen3-0.6B shape, {args.layers} layers, {dtype}, {platform} "
        f"({jax.devices()[0].device_kind}), prompts of 32-96 tokens, temperature 1",
        flush=True,
    )
    limits = dict(args.limit)
    checked_plain = False
    for name, rows, tokens in cell_order(args):
        limit_name = "plain" if name == "plain JAX" else name
        if rows * tokens > limits.get(limit_name, rows * tokens):
            print(
                f"  {name:>12} {rows:>4} rows x {tokens:>4} tokens: skipped (--limit {limit_name}=...)"
            )
            continue
        prompts = prompts_for(rows)
        if name == "plain JAX":
            if not checked_plain and dtype == "float32":  # bfloat16's rounding parts paths early
                check_plain(
                    registry, model, seq_len, dtype, platform,
                    "kv" if "kv" in args.engines else args.engines[0],
                )  # fmt: skip
                checked_plain = True
            timed = plain_generation.time_plain(
                model, prompts, tokens, args.repeats, seq_len=seq_len
            )
        elif name == "transformers":
            timed = time_transformers(args.layers, prompts, tokens, args.repeats)
            if timed is None:
                continue
        else:
            spec = engine_spec(model, seq_len, rows, dtype, platform)
            # The paged engine prefills every prompt of a call at once (as marinrl runs it).
            config = (
                registry.get("engine", name).config_class(max_prefill_tokens=max(2048, rows * 128))
                if name == "paged"
                else None
            )
            engine = registry.build_engine(name, spec, config)
            timed = time_engine(engine, prompts, tokens, args.repeats, seed=0)
            del engine
        seconds, generated = timed
        print(
            f"  {name:>12} {rows:>4} rows x {tokens:>4} tokens: {generated / seconds:9.1f} "
            f"tok/s ({seconds:.2f} s)",
            flush=True,
        )
        cells.emit(name=name, rows=rows, tokens=tokens, rate=generated / seconds)


def main() -> None:
    args = parse_args()
    import cells

    if cells.in_child():
        measure(args)
        return
    records, _ = cells.run_in_child()
    results = {(r["name"], r["rows"], r["tokens"]): r["rate"] for r in records}
    kinds = [
        k for k in [*args.engines, "plain JAX", "transformers"] if any(c[0] == k for c in results)
    ]
    print()
    print("| engine | rows x new tokens | tok/s | / paged | / plain JAX | / transformers |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in args.rows:
        for tokens in args.tokens:
            for kind in kinds:
                rate = results.get((kind, rows, tokens))
                if rate is None:
                    continue
                paged = results.get(("paged", rows, tokens))
                hf = results.get(("transformers", rows, tokens))
                plain = results.get(("plain JAX", rows, tokens))
                print(
                    f"| {kind} | {rows} x {tokens} | {rate:,.0f} | "
                    f"{f'{rate / paged:.2f}x' if paged else '-'} | "
                    f"{f'{rate / plain:.2f}x' if plain else '-'} | "
                    f"{f'{rate / hf:.2f}x' if hf else '-'} |"
                )
    first = (args.rows[0], args.tokens[0])
    kv, paged = results.get(("kv", *first)), results.get(("paged", *first))
    if kv and paged:
        print(f"speed-up over paged: {kv / paged:.2f}x")
    else:
        print("speed-up over paged: n/a (run both the kv and the paged engine)", file=sys.stderr)


if __name__ == "__main__":
    main()
