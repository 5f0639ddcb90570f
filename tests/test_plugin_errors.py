"""Every plugin mistake a user can make stops the CLI with a documented exit code and a fix."""

from __future__ import annotations

import json

from marin_rl_core import ExitCode

ENV_MODULE = """
import attrs
from marin_rl_core import EnvPlugin, Problem, hookimpl

@attrs.frozen
class Cfg:
    level: int = 1

class TwinEnv:
    def __init__(self, config):
        self.config = config
    def sample_problems(self, n, *, mode, seed):
        return [Problem(id=str(i), prompt="1+1=", answer="2") for i in range(n)]
    def score(self, problem, response):
        return float(response == problem.answer)

@hookimpl
def marinrl_register_envs():
    yield EnvPlugin(name="twin", summary="{summary}", config_class=Cfg, build=TwinEnv)
"""


def test_unknown_env_lists_registered_names_and_suggests_the_closest(cli):
    result = cli("config", "show", "--env", "maht")
    assert result.exit_code == ExitCode.UNKNOWN_PLUGIN == 4
    assert "unknown env 'maht'" in result.output
    assert "Did you mean 'math'?" in result.output
    assert "Registered env plugins:" in result.output and "mock" in result.output
    # Plugin names are lowercase: a name in capitals is suggested too (docs/cli.md promises it).
    result = cli("run", "--loss", "RLOO")
    assert result.exit_code == ExitCode.UNKNOWN_PLUGIN
    assert "unknown loss 'RLOO'" in result.output and "Did you mean 'rloo'?" in result.output


def test_unknown_name_in_a_config_file_names_its_path(cli, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[loss]\nname = "rlooo"\n')
    result = cli("config", "validate", str(path))
    assert result.exit_code == ExitCode.UNKNOWN_PLUGIN
    assert "$.loss.name" in result.output and "Did you mean 'rloo'?" in result.output


def test_plugin_that_fails_to_import_names_its_distribution_and_the_way_out(cli, install_dist):
    install_dist(
        "marinrl-broken",
        "1.2.3",
        entry_points={"broken": "broken_plugin_mod"},
        modules={"broken_plugin_mod": "import module_that_does_not_exist\n"},
    )
    result = cli("plugins", "list")
    assert result.exit_code == ExitCode.PLUGIN_IMPORT == 5
    assert "plugin 'broken'" in result.output
    assert "marinrl-broken 1.2.3" in result.output
    assert "module_that_does_not_exist" in result.output
    assert "--disable-plugin broken" in result.output

    # ... and the advice works.
    result = cli("plugins", "list", "--disable-plugin", "broken", "--json")
    assert result.exit_code == 0
    assert "broken" not in {row["plugin"] for row in __import__("json").loads(result.output)}


def test_two_plugins_registering_one_name_list_both_providers(cli, install_dist):
    install_dist(
        "marinrl-twin-a",
        "0.1.0",
        entry_points={"twin_a": "twin_a_mod"},
        modules={"twin_a_mod": ENV_MODULE.replace("{summary}", "A")},
    )
    install_dist(
        "marinrl-twin-b",
        "0.9.0",
        entry_points={"twin_b": "twin_b_mod"},
        modules={"twin_b_mod": ENV_MODULE.replace("{summary}", "B")},
    )
    result = cli("plugins", "list")
    assert result.exit_code == ExitCode.DUPLICATE_PLUGIN == 6
    assert "2 plugins register the env name 'twin'" in result.output
    assert "plugin 'twin_a' from marinrl-twin-a 0.1.0" in result.output
    assert "plugin 'twin_b' from marinrl-twin-b 0.9.0" in result.output

    result = cli("plugins", "list", "--disable-plugin", "twin_b", "--kind", "env", "--json")
    assert result.exit_code == 0
    assert "marinrl-twin-a" in result.output and "marinrl-twin-b" not in result.output


def test_hookimpl_matching_no_hookspec_is_an_error(cli, install_dist):
    install_dist(
        "marinrl-typo",
        "0.0.1",
        entry_points={"typo": "typo_plugin_mod"},
        modules={
            "typo_plugin_mod": """
            from marin_rl_core import hookimpl

            @hookimpl
            def marinrl_register_env():  # missing the final s
                return []
            """
        },
    )
    result = cli("plugins", "list")
    assert result.exit_code == ExitCode.PLUGIN_CONTRACT == 7
    assert "'marinrl_register_env'" in result.output
    assert "matches no marinrl hookspec" in result.output
    assert "Did you mean 'marinrl_register_envs'?" in result.output
    assert "marinrl-typo 0.0.1" in result.output


def test_extra_plugin_module_that_fails_to_import_names_the_flag(cli):
    result = cli("plugins", "list", "--plugin", "no_such_plugin_module")
    assert result.exit_code == ExitCode.PLUGIN_IMPORT
    assert "'no_such_plugin_module' (given with --plugin)" in result.output


def test_extra_plugin_module_is_loaded_and_listed(cli, install_dist):
    install_dist(
        "local-stuff",
        "0.0.0",
        entry_points={},
        modules={"twin_local": ENV_MODULE.replace("{summary}", "local twin")},
    )
    result = cli("plugins", "list", "--plugin", "twin_local", "--kind", "env", "--json")
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in __import__("json").loads(result.output)}
    assert rows["twin"]["plugin"] == "twin_local"
    assert rows["twin"]["summary"] == "local twin"
    assert rows["twin"]["hooks"] == ["marinrl_register_envs"]
    # The plugin flags also work before the subcommand, as docs/writing-plugins.md shows them.
    before = cli("--plugin", "twin_local", "plugins", "list", "--kind", "env", "--json")
    assert before.exit_code == 0, before.output
    assert json.loads(before.output) == json.loads(result.output)
    skipped = cli("--disable-plugin", "mock", "plugins", "list", "--kind", "env", "--json")
    names = [row["name"] for row in json.loads(skipped.output)]
    assert "mock" not in names and "math" in names


def test_a_plugin_disabled_by_the_users_own_flag_is_named_as_disabled(cli):
    result = cli("config", "show", "--disable-plugin", "rloo", "--loss", "rloo")
    assert result.exit_code == ExitCode.UNKNOWN_PLUGIN, result.output
    assert "'rloo' is installed but disabled by --disable-plugin rloo" in result.output
    other = cli("config", "show", "--disable-plugin", "guess", "--loss", "rlooo")
    assert "Disabled with --disable-plugin: guess." in other.output
    assert "Did you mean 'rloo'?" in other.output


def test_disabling_a_plugin_that_is_not_installed_is_an_error(cli):
    for args in (
        ["--disable-plugin", "mok", "plugins", "list"],
        ["config", "show", "--disable-plugin", "mok"],
    ):
        result = cli(*args)
        assert result.exit_code == ExitCode.UNKNOWN_PLUGIN, result.output
        assert "unknown plugin 'mok' (at --disable-plugin)" in result.output
        assert "Did you mean 'mock'?" in result.output


def test_registration_hook_yielding_the_wrong_record_type_is_an_error(cli, install_dist):
    install_dist(
        "marinrl-wrong",
        "1.0",
        entry_points={"wrong": "wrong_plugin_mod"},
        modules={
            "wrong_plugin_mod": """
            import attrs
            from marin_rl_core import LossPlugin, hookimpl

            @attrs.frozen
            class C:
                x: int = 1

            @hookimpl
            def marinrl_register_envs():
                yield LossPlugin(name="oops", summary="s", config_class=C, build=lambda c: c)
            """
        },
    )
    result = cli("plugins", "list")
    assert result.exit_code == ExitCode.PLUGIN_CONTRACT
    assert "marinrl_register_envs must yield EnvPlugin records, got LossPlugin" in result.output


def test_a_build_that_cannot_take_its_kinds_arguments_is_refused_when_plugins_load(
    cli, install_dist
):
    """A storage's ``build`` is ``build(config, run)``; one written as ``build(config)`` fails
    while the plugins load (exit 7, naming the signature wanted), not inside a job."""
    install_dist(
        "marinrl-shortbuild",
        "1.0",
        entry_points={"shortbuild": "shortbuild_mod"},
        modules={
            "shortbuild_mod": """
            import attrs
            from marin_rl_core import StoragePlugin, hookimpl

            @attrs.frozen
            class C:
                x: int = 1

            def make_storage(config):
                raise AssertionError("never called")

            @hookimpl
            def marinrl_register_storages():
                yield StoragePlugin(name="short", summary="s", config_class=C, build=make_storage)
            """
        },
    )
    result = cli("plugins", "list")
    out = " ".join(result.output.split())
    assert result.exit_code == ExitCode.PLUGIN_CONTRACT, out
    assert "storage plugin 'short': build must take (config, run) (docs/hooks.md)" in out, out
    assert "make_storage(config) cannot" in out and "--disable-plugin shortbuild" in out, out


def test_an_unforeseen_error_is_one_line_and_its_traceback_goes_to_a_file(tmp_path):
    """A bug in marinrl itself (injected here into config resolution) must not dump a
    traceback on the user: one line naming the error and the file that holds the traceback."""
    import os
    import re
    import subprocess
    import sys

    inject = (
        "import sys, marin_rl_core.config.loading as config, marin_rl_core.cli as cli\n"
        "def buggy(*args, **kwargs):\n"
        "    return {}['no such key']\n"
        "config.resolve_config = buggy\n"
        "sys.argv = ['marinrl', 'config', 'show']\n"
        "cli.main()\n"
    )
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", inject], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == ExitCode.FAILURE
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "unexpected KeyError: 'no such key'" in proc.stderr
    log = re.search(r"The traceback is in (\S+);", proc.stderr)
    assert log and log.group(1).startswith(str(tmp_path)), proc.stderr
    assert "def buggy" not in proc.stderr and "buggy" in open(log.group(1)).read()


INEXACT_ENGINE = """
import attrs
from marin_rl_core import EnginePlugin, hookimpl


@attrs.frozen
class Config:
    pass


def build(config, spec):
    return spec.build_engine("kv")


@hookimpl
def marinrl_register_engines():
    yield EnginePlugin(name="approx", summary="a server's logprobs", config_class=Config,
                       build=build, exact_logprobs=False)
"""


def test_an_engine_without_the_trainers_logprobs_is_refused_before_the_job_starts(
    cli, tmp_path, monkeypatch, tiny_mock_job
):
    """An engine registered with exact_logprobs=False cannot train (every loss's importance
    ratio rests on the behaviour logprobs): `marinrl run` says so, names the engines that can,
    and exits with the config error before anything is written."""
    (tmp_path / "approx_engine.py").write_text(INEXACT_ENGINE)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = cli(
        "--plugin", "approx_engine", "run", *tiny_mock_job, "--engine", "approx",
        "--set", f'run_dir="{tmp_path}"', "--run-id", "approx",
    )  # fmt: skip
    assert result.exit_code == ExitCode.CONFIG, result.output
    assert "$.engine.name: the approx engine does not report the logprobs" in result.output
    assert "(auto, dense, kv, paged)" in result.output
    assert not (tmp_path / "approx").exists()
