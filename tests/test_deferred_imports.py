"""marin_rl_core.deferred_imports: what levanter imports and a job's processes rarely use
(``datasets``, pandas, ``transformers.models``) is imported on first use, and works as usual then;
transformers' index of its model files is kept between processes. Each case runs in a fresh
interpreter (the pytest process has imported everything already)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def _python(code: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=300, env={**os.environ, "USE_TORCH": "0", **(env or {})},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_levanter_imports_without_them_and_each_works_on_first_use():
    out = _python(
        """
        import sys
        from marin_rl_core.deferred_imports import DeferredModule, defer

        defer()
        import levanter  # noqa: F401  (imports both, at its import)
        import levanter.compat.hf_checkpoints  # noqa: F401
        deferred = lambda name: isinstance(sys.modules.get(name), DeferredModule)
        print("after levanter:", *map(deferred, ("datasets", "pandas", "transformers.models")))

        import transformers
        from transformers import AutoConfig, LlamaConfig
        from transformers.models import auto  # a submodule: no need of the package's index
        print("classes:", AutoConfig.__name__, LlamaConfig.__name__, auto.__name__)
        print("still deferred:", deferred("transformers.models"))
        names = transformers.models.MODEL_NAMES_MAPPING  # the package's own: imported now
        print("index:", "llama" in names, deferred("transformers.models"))

        import datasets
        table = datasets.Dataset.from_dict({"a": [1, 2, 3]})
        print("datasets:", table.num_rows, deferred("datasets"), bool(datasets.__version__))
        import pandas
        print("pandas:", len(table.to_pandas()), deferred("pandas"))
        """
    )
    assert "after levanter: True True True" in out
    assert "classes: AutoConfig LlamaConfig transformers.models.auto" in out
    assert "still deferred: True" in out
    assert "index: True False" in out
    assert "datasets: 3 False True" in out
    assert "pandas: 3 False" in out


def test_a_module_that_is_not_installed_fails_to_import_as_before():
    out = _python(
        """
        from marin_rl_core.deferred_imports import defer

        defer({"no_such_module_marinrl": False})
        try:
            import no_such_module_marinrl  # noqa: F401
        except ModuleNotFoundError as exc:
            print("raised:", exc.name)
        """
    )
    assert "raised: no_such_module_marinrl" in out


def test_a_submodule_imported_first_runs_once_with_its_package_imported():
    """Unpickling a data frame imports ``pandas.core.frame`` before anything used ``pandas``:
    the package is imported first (its submodules need it) and the submodule is not run a
    second time (one ``DataFrame`` class, not two)."""
    import pickle

    import pandas

    frame = pickle.dumps(pandas.DataFrame({"a": [1, 2, 3]}))
    out = _python(
        f"""
        import collections, pickle, sys
        from marin_rl_core.deferred_imports import DeferredModule, defer

        runs = collections.Counter()  # each module body run, by file
        sys.addaudithook(
            lambda event, args: event == "exec" and runs.update([args[0].co_filename])
        )
        defer()
        import pandas
        print("deferred:", isinstance(sys.modules["pandas"], DeferredModule))
        table = pickle.loads({frame!r})
        import pandas.core.frame
        print("one class:", type(table) is pandas.DataFrame is pandas.core.frame.DataFrame)
        print("its spec:", pandas.core.frame.__spec__.origin.endswith("frame.py"), len(table))
        from datasets.features import Features
        import datasets
        print("datasets:", Features is datasets.Features)
        print("run twice:", [f for f, n in runs.items() if n > 1 and "site-packages" in f])
        """
    )
    assert "deferred: True" in out
    assert "one class: True" in out and "its spec: True 3" in out
    assert "datasets: True" in out
    assert "run twice: []" in out


def test_transformers_index_of_its_models_is_read_from_the_cache_by_later_processes(tmp_path):
    """The first process to import transformers reads its model files' sources to index their
    names and keeps the index; a later one reads the index instead of the files, and every
    name imports as before."""
    code = """
        import sys
        opened = []
        sys.addaudithook(lambda event, args: event == "open" and isinstance(args[0], str)
                         and "transformers/models/" in args[0] and opened.append(args[0]))
        from marin_rl_core.deferred_imports import defer

        defer()
        import transformers
        from transformers import AutoConfig, LlamaConfig, PreTrainedTokenizerFast
        print("names:", AutoConfig.__name__, LlamaConfig.__name__, PreTrainedTokenizerFast.__name__)
        print("opened:", len(opened))
        from transformers.utils import import_utils
        kept = import_utils.define_import_structure
        from pathlib import Path
        models = Path(transformers.__file__).parent / "models"
        fresh = kept.__wrapped__.__wrapped__  # (under transformers' own lru_cache)
        print("same index:", kept(models, "models") == fresh(models, "models"))
    """
    cache = {"MARINRL_CACHE_DIR": str(tmp_path)}
    first, again = _python(code, env=cache), _python(code, env=cache)
    for out in (first, again):
        assert "names: AutoConfig LlamaConfig PreTrainedTokenizerFast" in out
        assert "same index: True" in out
    opened = [int(out.split("opened: ")[1].split()[0]) for out in (first, again)]
    assert opened[0] > 1000 and opened[1] < 100, opened


def test_a_kept_index_is_built_again_when_a_file_changes_or_the_cache_is_not_an_index(
    tmp_path, monkeypatch
):
    from marin_rl_core.deferred_imports import index_cache_dir, kept_index

    monkeypatch.setenv("MARINRL_CACHE_DIR", str(tmp_path / "cache"))
    models = tmp_path / "models"
    (models / "llama").mkdir(parents=True)
    source = models / "llama" / "modeling_llama.py"
    source.write_text("__all__ = ['LlamaModel']\n")
    built = []

    def build(module_path, prefix=None):
        built.append(module_path)
        return {frozenset({"torch"}): {f"{prefix}.llama.modeling_llama": {"LlamaModel"}}}

    define = kept_index(build)
    first = define(models, "models")
    first[frozenset({"torch"})]["models.other"] = {"Other"}  # (transformers adds to it)
    again = define(models, "models")
    assert len(built) == 1
    assert again == {frozenset({"torch"}): {"models.llama.modeling_llama": {"LlamaModel"}}}

    source.write_text("__all__ = ['LlamaModel', 'LlamaForCausalLM']\n")
    define(models, "models")
    assert len(built) == 2, "a changed file: indexed again"
    for garbage in ("{not json", '{"a": 1}', '[[["torch"], {"m": "not a list"}]]'):
        for path in index_cache_dir().iterdir():
            path.write_text(garbage)
        assert define(models, "models") == again
    assert len(built) == 5
