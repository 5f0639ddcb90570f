"""Ray resources per role: actors ask for what [resources] says, and a job the cluster cannot
place fails before anything starts, naming what was asked and what exists."""

from __future__ import annotations

import pytest

from marin_rl_core import build_registry
from marin_rl_core.config import resolve_config
from marin_rl_core.errors import ExitCode, ResourcesUnavailableError
from marin_rl_core.job.checks import check_resources

# What `ray.nodes()` reports for a 2-core machine without accelerators, and a GPU node.
CPU_NODE = {"CPU": 2.0, "memory": 8 * 2**30, "object_store_memory": 2**30, "node:127.0.0.1": 1.0}
GPU_NODE = {"CPU": 8.0, "GPU": 2.0, "memory": 64 * 2**30, "node:127.0.0.2": 1.0}


def config_with(*overrides: str):
    return resolve_config(build_registry(), selections={"env": "mock"}, overrides=list(overrides))


def test_requests_become_ray_actor_options():
    config = config_with(
        "resources.trainer.num_gpus=1",
        "resources.trainer.memory_gb=2",
        "resources.rollout.num_cpus=1",
        "resources.rollout.custom={TPU = 4}",
    )
    assert config.resources.trainer.ray_options() == {
        "num_cpus": 0.0,
        "num_gpus": 1.0,
        "memory": 2 * 2**30,
    }
    assert config.resources.rollout.ray_options() == {
        "num_cpus": 1.0,
        "num_gpus": 0.0,
        "resources": {"TPU": 4.0},
    }


def test_what_the_cluster_has_passes():
    check_resources(config_with(), [CPU_NODE])
    check_resources(
        config_with(
            "resources.trainer.num_gpus=2", "num_rollout_workers=4", "resources.rollout.num_cpus=1"
        ),
        [CPU_NODE, GPU_NODE],
    )


def test_a_gpu_on_a_cluster_without_one_names_the_role_the_request_and_what_exists():
    with pytest.raises(ResourcesUnavailableError) as info:
        check_resources(config_with("resources.trainer.num_gpus=1"), [CPU_NODE])
    message = str(info.value)
    assert "the trainer asks for 1 GPU ($.resources.trainer), and no node has that" in message
    assert "The cluster has 2 CPU, 8.0 GiB memory." in message
    assert info.value.exit_code == ExitCode.RESOURCES


def test_requests_that_fit_one_by_one_but_not_together_are_refused():
    config = config_with("num_rollout_workers=3", "resources.rollout.num_gpus=1")
    with pytest.raises(
        ResourcesUnavailableError, match="together the trainer and 3 rollout worker"
    ):
        check_resources(config, [CPU_NODE, GPU_NODE])


def test_a_trainer_over_more_hosts_than_the_cluster_can_hold_is_refused():
    """``resources.trainer`` is what each of the trainer's hosts asks for."""
    config = config_with("resources.trainer_hosts=3", "resources.trainer.num_gpus=1")
    with pytest.raises(ResourcesUnavailableError) as info:
        check_resources(config, [CPU_NODE, GPU_NODE])
    assert "together the trainer hosts (3) and 1 rollout worker(s) ask for 3 GPU" in str(info.value)
    check_resources(
        config_with("resources.trainer_hosts=2", "resources.trainer.num_gpus=1"),
        [CPU_NODE, GPU_NODE],
    )
    with pytest.raises(ResourcesUnavailableError) as info:
        check_resources(config_with("resources.trainer_hosts=2", "resources.trainer.num_gpus=3"),
                        [CPU_NODE, GPU_NODE])  # fmt: skip
    assert "each of the trainer's 2 hosts asks for 3 GPU" in str(info.value)


def test_no_single_node_big_enough_is_refused_even_when_the_total_is():
    config = config_with("resources.trainer.num_cpus=9")
    with pytest.raises(ResourcesUnavailableError, match="no node has that"):
        check_resources(config, [CPU_NODE, GPU_NODE])


def test_marinrl_run_asking_for_a_gpu_here_fails_fast(cli, tiny_mock_job, tmp_path):
    result = cli(
        "run",
        *tiny_mock_job,
        "--set",
        "resources.trainer.num_gpus=1",
        "--set",
        f'run_dir="{tmp_path}"',
    )
    assert result.exit_code == ExitCode.RESOURCES, result.output
    assert "the trainer asks for 1 GPU" in result.output
    assert "Traceback" not in result.output
