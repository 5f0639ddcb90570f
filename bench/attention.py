"""The ``kv`` engine's attention against ``jax.nn.dot_product_attention``, side by side.

Issue 48 asks that the engine attend "through ``jax.nn.dot_product_attention`` or a Pallas kernel
where that is faster, measured". This measures it at Qwen3-0.6B's heads (16 query heads in 8
key/value groups of 128) on the two shapes the engine runs:

- *decode*: one query token per row over a window of the cache, each row seeing its own length:
  the engine's layout (keys kept transposed ``[row, kv_head, head_size, position]``, values
  ``[row, kv_head, position, head_size]``, an einsum each, softmax in float32:
  ``kv_decode.attend``) against ``dot_product_attention`` on the ``[row, position, kv_head,
  head_size]`` layout it takes, each row's length as ``key_value_seq_lengths``;
- *prefill*: right-padded prompts attending causally to themselves.

``dot_product_attention`` runs with ``implementation="xla"`` everywhere and ``"cudnn"`` (cuDNN's
fused attention) where JAX has a GPU; an implementation that refuses a shape is reported, not
fatal. Each timing is ``--layers`` attentions chained inside one jit (a layer's worth of
dispatch, not Python's, is what is measured), the median of ``--repeats`` calls. Outputs are
checked equal first (float32 tolerance; bf16 on a GPU).

    python bench/attention.py                        # CPU: float32, 32 rows, window 256
    python bench/attention.py --rows 32 256 --windows 256 1024 --dtype bfloat16   # a GPU

The last line is ``dot_product_attention (best) / kv engine, decode: N.NNx`` at the first
rows and window: above 1 means the library's attention would be faster in the engine. The shapes
are measured in a child process (bench/cells.py): a time limit or Ctrl-C stops it at once and
prints the table of the shapes measured so far.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

HEADS, KV_HEADS, HEAD_SIZE = 16, 8, 128
SCALE = 1.0 / HEAD_SIZE**0.5


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """What :func:`marin_rl_core.rollout.kv_decode.attend` reads of an attention config."""

    head_size: int = HEAD_SIZE
    scaling_factor: float | None = None
    logits_soft_cap: float | None = None


def _timed(fn, *args, repeats: int) -> float:  # type: ignore[no-untyped-def]
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _chain(attention, layers: int):  # type: ignore[no-untyped-def]
    """``layers`` attentions in one jit, each query nudged by the step so none is hoisted."""

    def run(q, *rest):  # type: ignore[no-untyped-def]
        def body(i, acc):  # type: ignore[no-untyped-def]
            nudged = q * (1 + i.astype(q.dtype) * jnp.asarray(1e-3, q.dtype))
            return acc + attention(nudged, *rest).astype(jnp.float32)

        first = attention(q, *rest).astype(jnp.float32)
        return jax.lax.fori_loop(1, layers, body, first)

    return jax.jit(run)


def decode_inputs(rows: int, window: int, dtype: jnp.dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((rows, HEADS, HEAD_SIZE), np.float32)
    k = rng.standard_normal((rows, window, KV_HEADS, HEAD_SIZE), np.float32)
    v = rng.standard_normal((rows, window, KV_HEADS, HEAD_SIZE), np.float32)
    lengths = rng.integers(1, window + 1, rows).astype(np.int32)
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v)), jnp.asarray(lengths)


def decode_engine(q, k, v, lengths):  # type: ignore[no-untyped-def]
    """The engine's decode attention on its own layouts (made outside the timing)."""
    from marin_rl_core.rollout.kv_decode import attend

    rows, window = k.shape[0], k.shape[-1]  # keys transposed: [row, kv_head, head, position]
    visible = (jnp.arange(window)[None, :] < lengths[:, None])[:, None, :]
    q5 = q.reshape(rows, KV_HEADS, HEADS // KV_HEADS, 1, HEAD_SIZE)
    return attend(AttentionShape(), q5, k, v, visible)[:, 0]


def decode_library(implementation: str):  # type: ignore[no-untyped-def]
    def run(q, k, v, lengths):  # type: ignore[no-untyped-def]
        out = jax.nn.dot_product_attention(
            q[:, None],
            k,
            v,
            scale=SCALE,
            key_value_seq_lengths=lengths,
            implementation=implementation,
        )
        return out.reshape(q.shape[0], -1)

    return run


def prefill_inputs(prompts: int, width: int, dtype: jnp.dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((prompts, width, HEADS, HEAD_SIZE), np.float32)
    k = rng.standard_normal((prompts, width, KV_HEADS, HEAD_SIZE), np.float32)
    v = rng.standard_normal((prompts, width, KV_HEADS, HEAD_SIZE), np.float32)
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


def prefill_engine(q, k, v):  # type: ignore[no-untyped-def]
    """The engine's prefill attention: its keys and values are fresh from the projections, so
    putting them in its layout is part of the timed work (unlike decode's cache)."""
    from marin_rl_core.rollout.kv_decode import attend

    p, t = q.shape[:2]
    q5 = q.reshape(p, t, KV_HEADS, HEADS // KV_HEADS, HEAD_SIZE).transpose(0, 2, 3, 1, 4)
    causal = jnp.broadcast_to(jnp.arange(t)[:, None] >= jnp.arange(t)[None, :], (p, t, t))
    return attend(AttentionShape(), q5, *_engine_layout(k, v), causal)


def prefill_library(implementation: str):  # type: ignore[no-untyped-def]
    def run(q, k, v):  # type: ignore[no-untyped-def]
        out = jax.nn.dot_product_attention(
            q, k, v, scale=SCALE, is_causal=True, implementation=implementation
        )
        return out.reshape(*q.shape[:2], -1)

    return run


def _engine_layout(k, v):  # type: ignore[no-untyped-def]
    """Keys ``[row, kv_head, head_size, position]``, values ``[row, kv_head, position, head]``."""
    return k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)


def _dtype(text: str) -> jnp.dtype:
    try:
        return jnp.dtype(text)
    except TypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: give float32 or bfloat16") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32])
    parser.add_argument("--windows", type=int, nargs="+", default=[256])
    parser.add_argument(
        "--prefill", type=int, nargs=2, default=[32, 128], metavar=("PROMPTS", "WIDTH")
    )
    parser.add_argument("--layers", type=int, default=28, help="attentions chained per timed call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dtype", type=_dtype, default=None, help="default: bfloat16 on a GPU, float32 else"
    )
    args = parser.parse_args()
    import cells

    if cells.in_child():
        measure_all(args)
        return
    records, _ = cells.run_in_child()
    implementations = next((r["implementations"] for r in records if "implementations" in r), [])
    rows = [r for r in records if "row" in r]
    print()
    print(
        "| shape | kv engine | "
        + " | ".join(f"dot_product_attention ({n})" for n in implementations)
        + " |"
    )
    print("| --- | --- | " + " | ".join("---" for _ in implementations) + " |")
    for r in rows:
        row = r["row"]
        print("| " + " | ".join(row + ["-"] * (2 + len(implementations) - len(row))) + " |")
    first_ratio = next((r["ratio"] for r in rows if r["ratio"] is not None), None)
    if first_ratio is None:
        print("dot_product_attention (best) / kv engine, decode: n/a (no implementation ran)")
    else:
        print(f"dot_product_attention (best) / kv engine, decode: {first_ratio:.2f}x")


def measure_all(args: argparse.Namespace) -> None:
    """The measuring child (bench/cells.py): emits the implementations, then a table row per
    shape with its decode ratio (best library time over the engine's; ``None`` for prefill)."""
    import cells

    gpu = jax.default_backend() == "gpu"
    dtype = args.dtype or jnp.dtype("bfloat16" if gpu else "float32")
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    implementations = ["xla", "cudnn"] if gpu else ["xla"]
    print(
        f"{jax.devices()[0].device_kind} ({jax.default_backend()}), {dtype.name}, "
        f"{HEADS} heads in {KV_HEADS} groups of {HEAD_SIZE}, {args.layers} attentions a call"
    )
    cells.emit(implementations=implementations)

    def measure(label: str, engine, library, engine_args, library_args) -> None:  # type: ignore[no-untyped-def]
        reference = np.asarray(jax.jit(engine)(*engine_args), np.float32)
        ours = _timed(_chain(engine, args.layers), *engine_args, repeats=args.repeats)
        best = None
        row = [label, f"{ours * 1e3:.2f} ms"]
        for name in implementations:
            fn = library(name)
            # An implementation may refuse a shape (cuDNN's has limits): reported, not fatal.
            try:
                got = np.asarray(jax.jit(fn)(*library_args), np.float32)
            except Exception as e:  # noqa: BLE001
                row.append(f"refused ({type(e).__name__}: {str(e).splitlines()[0][:60]})")
                continue
            if not np.allclose(got, reference, atol=tolerance, rtol=tolerance):
                gap = float(np.max(np.abs(got - reference)))
                row.append(f"differs (max {gap:.3g})")
                continue
            seconds = _timed(_chain(fn, args.layers), *library_args, repeats=args.repeats)
            row.append(f"{seconds * 1e3:.2f} ms ({ours / seconds:.2f}x)")
            best = seconds if best is None else min(best, seconds)
        decode = label.startswith("decode") and best is not None
        cells.emit(row=row, ratio=ours / best if decode else None)

    for rows in args.rows:
        for window in args.windows:
            (q, k, v), lengths = decode_inputs(rows, window, dtype)
            kt, vt = _engine_layout(k, v)
            measure(
                f"decode {rows} rows, window {window}",
                decode_engine,
                decode_library,
                (q, kt, vt, lengths),
                (q, k, v, lengths),
            )
    prompts, width = args.prefill
    q, k, v = prefill_inputs(prompts, width, dtype)
    measure(f"prefill {prompts} x {width}", prefill_engine, prefill_library, (q, k, v), (q, k, v))


if __name__ == "__main__":
    main()
