"""SWE sandbox on the Docker backend: conformance, real SWE-bench grading in the instance image, confinement.

Instance images are built from generated tasks on the base image ``scripts/setup.sh`` makes without a registry
(``tests/sandboxes/conftest.py``); every test skips, with the reason, where no Docker engine can run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from sandbox_adapters.swebench.grading import swebench_available
from tests.sandboxes.test_swebench import SWEConformanceHooks, bash

pytestmark = [
    pytest.mark.slow,  # instance images and containers: outside the fast tier
    pytest.mark.envs,
    pytest.mark.skipif(not swebench_available(), reason="the `swebench` package (envs extra) is not installed"),
]


def _sandbox(cache, **overrides):
    from sandbox_adapters.swebench import SWEBenchSandbox

    return SWEBenchSandbox(SWEBenchSandbox.Config(backend="docker", docker_cache_dir=cache, **overrides))


class TestSWEDockerConformance(SWEConformanceHooks):
    """Overlay snapshots (the memory backend runs the same suite locally and the Docker budget tests)."""

    snapshot_backend = "overlay"
    sampler_step_timeout_s = 6.0

    @pytest.fixture(autouse=True)
    def _task(self, swe_docker_tasks):
        tasks, self._cache = swe_docker_tasks
        self._the_task = tasks[0]

    def make_sandbox(self):
        return _sandbox(self._cache, snapshot_backend=self.snapshot_backend)


def test_grading_in_the_image_empty_patch_unresolved_gold_resolved(swe_docker_tasks):
    tasks, cache = swe_docker_tasks
    with _sandbox(cache) as sandbox:
        for task in tasks:
            sandbox.reset(task)
            result = sandbox.step("submit")
            assert result.done and result.reward == 0.0 and result.info["fail_to_pass_failures"] >= 1, result
            sandbox.reset(task)
            applied = sandbox.step(bash(f"git apply <<'EOF'\n{task['patch']}EOF\ngit status --short"))
            assert "[exit code 0]" in applied.observation.text
            result = sandbox.step("submit")
            assert result.done and result.reward == 1.0 and result.info["resolved"], result


def test_no_network_read_only_root_and_only_the_image_is_visible(swe_docker_tasks, tmp_path):
    tasks, cache = swe_docker_tasks
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    host_file = tmp_path / "host.txt"
    host_file.write_text("host")
    probe = (f"import socket\nfor addr in [('127.0.0.1', {port}), ('1.1.1.1', 80), ('172.17.0.1', 80)]:\n"
             "    try:\n        socket.create_connection(addr, timeout=2); print('CONNECTED', addr)\n"
             "    except OSError as e:\n        print('FAILED', addr, e.errno)\n")
    try:
        with _sandbox(cache) as sandbox:
            sandbox.reset(tasks[0])
            sandbox.step(f"```write probe.py\n{probe}```")
            net = sandbox.step(bash("python probe.py")).observation.text
            writes = sandbox.step(bash(f"echo x > /usr/x; echo x > /etc/x; echo x > /x; cat {host_file}; "
                                       "echo ok > /tmp/t && cat /tmp/t; id -u")).observation.text
        assert "CONNECTED" not in net and net.count("FAILED") == 3, net
        with pytest.raises(socket.timeout):  # nothing reached the host's loopback listener
            listener.accept()
    finally:
        listener.close()
    assert writes.count("Read-only file system") == 3, writes
    assert f"{host_file}: No such file or directory" in writes and "ok\n65534" in writes, writes


@pytest.mark.timing
def test_a_runaway_command_is_killed_and_the_sandbox_goes_on(swe_docker_tasks):
    tasks, cache = swe_docker_tasks
    with _sandbox(cache, command_timeout_s=3.0) as sandbox:
        sandbox.reset(tasks[0])
        sandbox.step(bash("true"))
        container = _busy_containers()
        start = time.monotonic()
        result = sandbox.step(bash("sleep 1000 & while true; do :; done"))
        assert time.monotonic() - start < 20
        assert result.info.get("timed_out") and "timed out" in result.observation.text
        # the time limit killed the command's processes, not the container
        left = sandbox.step(bash("for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done | "
                                 "grep -c 'slee[p] 1000'")).observation.text
        assert left.startswith("0\n"), left
        assert _busy_containers() == container
        bomb = sandbox.step(bash(":(){ :|:& };:; sleep 2; echo survived"))
        assert "alive" in sandbox.step(bash("echo alive")).observation.text
    assert not _busy_containers(), "a container outlived its sandbox (other than the clean ones kept for reuse)"
    assert "Resource temporarily unavailable" in bomb.observation.text or bomb.info.get("timed_out"), bomb


def _busy_containers() -> set[str]:
    """Running sandbox containers that are not clean ones kept for reuse."""
    from sandbox_adapters.swebench.docker import CONTAINER_LABEL, idle_containers

    running = subprocess.run(["docker", "ps", "--format", "{{.Names}}", "--filter",
                              f"label={CONTAINER_LABEL}={os.getpid()}"], capture_output=True, text=True, check=True)
    return set(running.stdout.split()) - set(idle_containers())


def test_one_long_lived_container_and_nothing_but_the_testbed_carries_over(swe_docker_tasks):
    """Commands share one container (by exec), yet a process or file outside /testbed never outlives its command."""
    tasks, cache = swe_docker_tasks
    escape = ("nohup sleep 391 >/dev/null 2>&1 & setsid sleep 392 >/dev/null 2>&1 < /dev/null & "
              "( ( sleep 393 >/dev/null 2>&1 & ) & ); echo kept > /tmp/t; echo kept > /dev/shm/s; "
              "mkdir -p /tmp/locked/deep && chmod 000 /tmp/locked; echo kept > kept.txt; chmod 600 kept.txt; "
              "ln -s /testbed/kept.txt /tmp/link; "
              "python3 -c 'import os; os.setsid(); os.fork() or os.execvp(\"sleep\", [\"sleep\", \"394\"])' & "
              "sleep 0.3; echo $$")
    with _sandbox(cache) as sandbox:
        sandbox.reset(tasks[0])
        first = sandbox.step(bash(escape)).observation.text
        seen = sandbox.step(bash("cat kept.txt; stat -c %a kept.txt; ls -A /tmp /dev/shm | wc -w; "
                                 "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done | "
                                 "grep -c 'slee[p] 39'"))
        # the cleaning of /tmp did not follow the link; the two directory headers only; no sleep of the first command
        assert seen.observation.text.split("\n")[:4] == ["kept", "600", "2", "0"], (first, seen.observation.text)
        assert len(_busy_containers()) == 1, "one container for all the commands of a sandbox"


def test_the_testbed_is_extracted_once_per_image(swe_docker_tasks, monkeypatch):
    from sandbox_adapters.swebench import docker as docker_backend

    tasks, cache = swe_docker_tasks
    with _sandbox(cache) as first:
        first.reset(tasks[1])  # extracted here, or by an earlier test
    calls = []
    original = docker_backend._docker
    monkeypatch.setattr(docker_backend, "_docker", lambda binary, *args, **kw: (calls.append(args[0]),
                                                                                  original(binary, *args, **kw))[1])
    with _sandbox(cache) as second:
        second.reset(tasks[1])
        assert "Wrote" in second.step("```write x.txt\nx\n```").observation.text
    assert "cp" not in calls and "create" not in calls


def test_image_names_follow_the_swebench_harness():
    from sandbox_adapters.swebench.docker import instance_image_name

    assert instance_image_name({"instance_id": "astropy__astropy-12907"}) == \
        "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    assert instance_image_name({"instance_id": "x__y-1", "image": "mine:1"}) == "mine:1"
    assert instance_image_name({"instance_id": "x__y-1", "image": "local"}).startswith("swebench/")


def test_prepare_maps_a_local_swe_bench_verified_copy_to_image_names(swe_tasks, tmp_path):
    """``prepare swebench --backend docker`` on a local copy of the dataset: no checkouts, one image per instance."""
    import json

    import pandas as pd

    from verl_bpo.data import prepare

    verified = tmp_path / "SWE-bench_Verified.jsonl"
    rows = []
    for task, instance_id in zip(swe_tasks[:2], ["astropy__astropy-12907", "django__django-11099"], strict=True):
        row = {k: v for k, v in task.items() if k not in ("repo_path", "image")}
        rows.append({**row, "instance_id": instance_id})
    rows[1]["image"] = "registry.example/own-build:7"  # an image the dataset names is kept
    verified.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    prepare.main(["swebench", "--backend", "docker", "--no-render", "--out", str(out),
                  "--train-instances", str(verified), "--val-instances", str(verified)])
    for split in ("train", "val"):
        written = pd.read_parquet(out / f"{split}.parquet").to_dict("records")
        sandbox = json.loads(written[0]["extra_info"]["sandbox"])
        assert sandbox["name"] == "swebench" and sandbox["config"]["backend"] == "docker"
        images = [json.loads(r["extra_info"]["task"])["image"] for r in written]
        assert images == ["swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest", "registry.example/own-build:7"]
        assert all("repo_path" not in json.loads(r["extra_info"]["task"]) for r in written)


def test_containers_of_a_process_that_died_are_reaped(swe_docker_tasks):
    """A trainer killed outright runs no exit hook: the next process removes its containers."""
    from sandbox_adapters.swebench import docker

    tasks, _ = swe_docker_tasks
    gone = subprocess.Popen(["true"])
    gone.wait()
    name = f"bpo-swe-orphan-{gone.pid}"
    subprocess.run(["docker", "run", "-d", "--name", name, "--network", "none", "--label",
                    f"{docker.CONTAINER_LABEL}={gone.pid}", "--entrypoint", "sleep", tasks[0]["image"], "infinity"],
                   check=True, capture_output=True)
    mine = f"bpo-swe-mine-{os.getpid()}"
    subprocess.run(["docker", "run", "-d", "--name", mine, "--network", "none", "--label",
                    f"{docker.CONTAINER_LABEL}={os.getpid()}", "--entrypoint", "sleep", tasks[0]["image"], "infinity"],
                   check=True, capture_output=True)
    try:
        assert docker.reap_orphans.__wrapped__() >= 1

        def exists(container: str) -> bool:
            return subprocess.run(["docker", "inspect", container], capture_output=True).returncode == 0

        assert not exists(name) and exists(mine)  # a live owner's containers stay
    finally:
        subprocess.run(["docker", "rm", "-f", name, mine], capture_output=True)
