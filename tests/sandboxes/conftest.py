"""Fixtures of the SWE sandbox tests: generated tasks, and their instance images for the Docker backend.

The Docker backend needs a running engine and the base image that ``scripts/setup.sh`` makes without any registry
(``debootstrap`` a minimal Debian with python3, git and pytest, then ``docker import``). Instance images are built
here from generated tasks, named the way the SWE-bench harness names its images (namespace ``bpo-local``), with
``/testbed`` on ``sys.path`` as in SWE-bench's images.
"""

from __future__ import annotations

import os

import pytest

from sandbox_adapters.swebench.confine import bwrap_path
from sandbox_adapters.swebench.docker import build_instance_image, docker_available
from sandbox_adapters.swebench.tasks import BUG_KINDS, generate_tasks

BASE_IMAGE = os.environ.get("BPO_SWE_BASE_IMAGE", "bpo/swe-base:bookworm")


@pytest.fixture(scope="session")
def swe_tasks(tmp_path_factory):
    """One generated task per bug kind (local checkouts)."""
    out = tmp_path_factory.mktemp("swe_tasks")
    instances = generate_tasks(str(out), num=len(BUG_KINDS), seed=0)
    return [{**inst, "repo_path": str(out / "repos" / inst["instance_id"])} for inst in instances]


def docker_skip_reason() -> str | None:
    """Why the Docker-backend tests cannot run here, or None."""
    if not docker_available():
        return ("no Docker engine answers (scripts/setup.sh installs docker.io and starts "
                "`dockerd --bridge=none --iptables=false` as root)")
    import subprocess

    if subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True).returncode != 0:
        return f"the SWE base image {BASE_IMAGE} is missing (scripts/setup.sh builds it with debootstrap)"
    return None


@pytest.fixture(scope="session")
def swe_docker_tasks(swe_tasks, tmp_path_factory):
    """The first three generated tasks with an instance image each (``task["image"]``), and the testbed cache."""
    reason = docker_skip_reason()
    if reason:
        pytest.skip(reason)
    from swebench.task.checks import expected_image

    tasks = []
    for task in swe_tasks[:3]:
        # the repository at base_commit, without its .git history beyond it, becomes the image's /testbed
        image = build_instance_image(expected_image(task["instance_id"], "bpo-local"), task["repo_path"], BASE_IMAGE)
        tasks.append({**{k: v for k, v in task.items() if k != "repo_path"}, "image": image})
    return tasks, str(tmp_path_factory.mktemp("swe_testbeds"))


@pytest.fixture(params=["local", "docker"])
def swe_backend(request, swe_tasks):
    """``(make, tasks)`` for each backend: ``make(**config)`` builds a sandbox of that backend."""
    from sandbox_adapters.swebench import SWEBenchSandbox

    if request.param == "local":
        if bwrap_path() is None:
            pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
        return (lambda **kw: SWEBenchSandbox(SWEBenchSandbox.Config(**kw))), swe_tasks
    tasks, cache = request.getfixturevalue("swe_docker_tasks")
    return (lambda **kw: SWEBenchSandbox(SWEBenchSandbox.Config(backend="docker", docker_cache_dir=cache, **kw))), tasks
