"""Ray's dashboard agent as the job's local Ray runs it (:func:`~marin_rl_core.job.local_ray.
lean_loopback_head`): ``python ray_agent_start.py AGENT_SCRIPT ARGS...`` runs Ray's
``dashboard/agent.py`` with ``ARGS`` exactly as the raylet would, except that Ray's check for
its dashboard's packages answers that they are not installed, as it does where Ray is installed
without ``[default]``.

The raylet needs its agent; the job needs none of the agent's modules. The local Ray already
starts the agent in Ray's minimal mode (no gRPC or HTTP server: no dashboard, no job or state
API), but the agent decides which of its modules to load by checking for those packages again,
and levanter installs them: it imported every module of ``ray.dashboard.modules`` and ran seven
of them (the reporter sampling the node's processes, event, log and job agents). With the check
answered it would load Ray's minimal modules alone, as a minimal Ray install's agent does, and
in Ray 2.60 there are none (``tests/test_ray_worker_start.py`` holds that for the installed
Ray); so the agent is not made to import all of ``ray.dashboard.modules`` to find that out.
Tiny mock job on a 2-core machine: the agent 0.68 -> 0.32 CPU-s.
"""

from __future__ import annotations

import os
import runpy
import sys


def no_dashboard() -> ImportError:
    """What Ray's check for its dashboard's packages answers in the local Ray's processes (the
    driver's ``ray.init`` too: :func:`~marin_rl_core.job.local_ray.lean_loopback_head`)."""
    return ImportError("this job's local Ray serves no dashboard")


def minimal_modules(module_type: type) -> list[type]:
    """The dashboard modules of ``module_type`` a minimal Ray install loads: none, for the
    agent's (``DashboardAgentModule``), in the Ray marinrl pins."""
    return []


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(script)  # as `python AGENT_SCRIPT` has it (not this directory)
    import ray._private.utils

    # Before the agent imports ray.dashboard.utils, which takes the check by name.
    ray._private.utils.get_dashboard_dependency_error = no_dashboard
    import ray.dashboard.utils

    ray.dashboard.utils.get_all_modules = minimal_modules
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
