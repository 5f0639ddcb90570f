"""Ray's dashboard agent as the job's local Ray runs it (:func:`~marin_rl_core.job.local_ray.
lean_loopback_head`): ``python ray_agent_start.py AGENT_SCRIPT ARGS...`` runs Ray's
``dashboard/agent.py`` with ``ARGS`` exactly as the raylet would, except that Ray's check for
its dashboard's packages answers that they are not installed, as it does where Ray is installed
without ``[default]``.

The raylet needs its agent; the job needs none of the agent's modules. The local Ray already
starts the agent in Ray's minimal mode (no gRPC or HTTP server: no dashboard, no job or state
API), but the agent decides which of its modules to load by checking for those packages again,
and levanter installs them: it imported every module of ``ray.dashboard.modules`` and ran seven
of them (the reporter sampling the node's processes, event and log agents), ~0.5 CPU-s at its
start on a 2-core machine and more while the job runs. With the check answered, it loads only
Ray's minimal modules (none in Ray 2.60), as a minimal Ray install's agent does.
"""

from __future__ import annotations

import os
import runpy
import sys


def _no_dashboard() -> ImportError:
    return ImportError("this job's local Ray serves no dashboard")


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(script)  # as `python AGENT_SCRIPT` has it (not this directory)
    import ray._private.utils

    # Before the agent imports ray.dashboard.utils, which takes the check by name.
    ray._private.utils.get_dashboard_dependency_error = _no_dashboard
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
