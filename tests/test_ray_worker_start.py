"""Where the local Ray's start-up script does not fork a worker (no fork server here), it starts it
exactly as Ray's own set-up script does; its dashboard agent's start-up script loads the modules
Ray's own selection loads in a minimal install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marin_rl_core.job.local_ray import SETUP_WORKER
from marin_rl_core.job.ray_worker_start import rays_own_script

WORKER = """
import json, os, sys
env = {k: os.environ.get(k) for k in ("MARINRL_T_A", "MARINRL_T_B", "MARINRL_T_C", "MARINRL_T_P")}
json.dump({"script": os.path.basename(__file__), "argv": sys.argv[1:], "env": env,
           "python": sys.executable}, open(os.environ["MARINRL_T_OUT"], "w"))
"""


def started_worker(setup: str, context: dict, tmp_path: Path, name: str, spelled: str) -> dict:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    (tmp_path / "other_worker.py").write_text(WORKER)
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "MARINRL_T_OUT": str(out), "MARINRL_T_P": "from-the-raylet"}
    raw = json.dumps(context)
    if spelled == "joined":
        options = [f"--serialized-runtime-env-context={raw}", "--language=PYTHON"]
    else:
        options = ["--language", "PYTHON", "--serialized-runtime-env-context", raw]
    command = [
        sys.executable,
        setup,
        *options,
        str(worker),
        "--node-ip-address=127.0.0.1",
        "an argument with spaces",
        "RAY_WORKER_DYNAMIC_OPTION_PLACEHOLDER",
    ]
    subprocess.run(command, env=env, check=True, timeout=60, cwd=tmp_path)
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "context",
    [
        {},
        {
            "env_vars": {
                "MARINRL_T_A": "a-${MARINRL_T_P}-$MARINRL_T_P",
                "MARINRL_T_B": "${NOT_SET_ANYWHERE}b",
            }
        },
        {"command_prefix": ["export", "MARINRL_T_C=from-the-prefix", "&&"]},
        {"py_executable": sys.executable, "override_worker_entrypoint": "other_worker.py"},
        {"py_executable": f"env MARINRL_T_C=from-a-command {sys.executable}"},
    ],
    ids=["empty", "env-vars", "command-prefix", "entrypoint", "python-as-a-command"],
)
def test_a_worker_starts_with_what_rays_own_setup_script_gives_it(context, tmp_path):
    ours = started_worker(SETUP_WORKER, context, tmp_path, "ours", "joined")
    rays = started_worker(rays_own_script(), context, tmp_path, "rays", "joined")
    assert ours == rays
    assert ours["argv"][-2:] == ["an argument with spaces", "RAY_WORKER_DYNAMIC_OPTION_PLACEHOLDER"]


def test_its_options_are_read_in_either_spelling(tmp_path):
    """``--option value`` as well as ``--option=value``, as Ray's argparse reads them."""
    context = {"env_vars": {"MARINRL_T_A": "apart"}}
    ours = started_worker(SETUP_WORKER, context, tmp_path, "ours", "apart")
    rays = started_worker(rays_own_script(), context, tmp_path, "rays", "apart")
    assert ours == rays and ours["env"]["MARINRL_T_A"] == "apart"


def test_what_it_does_not_know_is_handed_to_rays_own_script(tmp_path):
    """A field of a newer Ray's context: Ray's own script gets it (and says what it is)."""
    with pytest.raises(subprocess.CalledProcessError):
        started_worker(SETUP_WORKER, {"a_new_field": 1}, tmp_path, "ours", "joined")
    assert not (tmp_path / "ours.json").exists()


def test_the_local_ray_starts_its_workers_through_it():
    from ray._private import ray_constants

    from marin_rl_core.job.local_ray import lean_loopback_head

    with lean_loopback_head():
        assert (
            os.path.join("/anywhere", "workers", ray_constants.SETUP_WORKER_FILENAME)
            == SETUP_WORKER
        )
    assert ray_constants.SETUP_WORKER_FILENAME == "setup_worker.py"


def test_a_ray_whose_setup_script_takes_other_options_keeps_its_own(tmp_path, monkeypatch):
    """A later Ray that gives its set-up script another option: its workers start through
    Ray's own script, which knows what to do with it."""
    from ray._private import ray_constants

    from marin_rl_core.job import ray_worker_start
    from marin_rl_core.job.local_ray import lean_loopback_head

    text = Path(rays_own_script()).read_text()
    newer = text.replace(
        'parser.add_argument("--language"',
        'parser.add_argument("--a-new-option", type=str)\nparser.add_argument("--language"',
    )
    assert newer != text
    newer_script = tmp_path / "setup_worker.py"
    newer_script.write_text(newer)
    monkeypatch.setattr(ray_worker_start, "rays_own_script", lambda: str(newer_script))
    with lean_loopback_head():
        assert ray_constants.SETUP_WORKER_FILENAME == "setup_worker.py"


AGENT_MODULES = """
import json
import ray._private.utils
ray._private.utils.get_dashboard_dependency_error = lambda: ImportError("no dashboard here")
import ray.dashboard.utils as utils
from marin_rl_core.job.ray_agent_start import minimal_modules
picked = utils.get_all_modules(utils.DashboardAgentModule)  # imports every module, as Ray does
print(json.dumps({
    "ray": [m.__name__ for m in picked],
    "ours": [m.__name__ for m in minimal_modules(utils.DashboardAgentModule)],
    "all": [m.__name__ for m in utils.DashboardAgentModule.__subclasses__()],
}))
"""


def test_the_local_rays_agent_loads_what_rays_own_selection_loads_in_a_minimal_install():
    """``ray_agent_start`` spares the dashboard agent Ray's walk through every dashboard module
    by answering what the walk would: the installed Ray, with its dashboard's packages missing
    (a minimal install), selects no agent module (there are several to choose from)."""
    proc = subprocess.run(
        [sys.executable, "-c", AGENT_MODULES], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(found["all"]) >= 3, found  # the walk found the agent's modules
    assert found["ours"] == found["ray"], found
