"""JAX's persistent compilation cache (``compilation_cache``): where it lives, and that a second
process loads the dense sampler's compiled function from it instead of compiling it again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from marin_rl_core.job.compile_cache import cache_dir

SAMPLE = textwrap.dedent(
    """
    import sys
    import jax
    from marin_rl_core.job import compile_cache
    from marin_rl_core.config import ModelConfig
    from marin_rl_core.rollout.dense_sampler import DenseSampler
    from marin_rl_core.rollout.inference import sample_prompts
    from marin_rl_core.models.build import build_model
    from marin_rl_core.models.tokenizer import ArithmeticTokenizer

    compile_cache.enable(sys.argv[1])
    tok = ArithmeticTokenizer()
    model = build_model(ModelConfig(), tok, key=jax.random.PRNGKey(0))
    sampler = DenseSampler(model, max_seq_len=16, eos_id=tok.eos_id, max_seqs=8)
    out = sample_prompts(sampler, [tok.encode("3+4=", add_bos=True)], n=2, max_tokens=2, seed=1)
    print([s.tokens.tolist() for s in out[0]])
    """
)


def test_the_cache_directory_setting(monkeypatch, tmp_path):
    assert cache_dir("") is None
    assert cache_dir(str(tmp_path / "x")) == tmp_path / "x"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert cache_dir("auto") == tmp_path / "jax"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir("auto") == tmp_path / "xdg" / "marinrl" / "jax"


def test_a_second_process_loads_the_sampler_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}

    def run() -> str:
        done = subprocess.run(
            [sys.executable, "-c", SAMPLE, str(cache)],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    first = run()
    entries = sorted(p.name for p in Path(cache).iterdir())
    assert entries, "the first run wrote no cache entry"
    second = run()
    # The same samples, and nothing new compiled: every function came from the cache.
    assert second == first
    assert sorted(p.name for p in Path(cache).iterdir()) == entries
