"""One budget per SWE sandbox, attacked with several processes at once, on both backends; and close() mid-step.

Per-process limits let N processes take N times a limit; these attacks check that memory, processes, CPU, disk
and ``/tmp`` are bounded for the sandbox as a whole (a cgroup and a loop-mounted disk locally, the container's
cgroup and the same disk with Docker), and that closing a sandbox while a command runs stops every process first.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time

import pytest

from sandbox_adapters.swebench.limits import cgroups_available, quota_disks_available

pytestmark = [
    pytest.mark.slow,  # a real sandbox per test and budgets run out on purpose: outside the fast tier
    pytest.mark.skipif(
        not (cgroups_available() and quota_disks_available()),
        reason="per-sandbox budgets need root (cgroups and loop-mounted disks); the SWE sandbox falls back to "
               "per-process limits without them"),
]


def bash(cmd: str) -> str:
    return f"```bash\n{cmd}\n```"


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def _processes_running(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker`` (a sleep of a duration no other test uses)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read().replace(b"\0", b" "):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_memory_is_one_budget_for_all_processes(swe_backend):
    make, tasks = swe_backend
    # three processes that each hold 300 MB for 3 s: every one fits the per-process limit, together they exceed the
    # budget, so at most one of them can hold its block to the end (the others are stopped by the OOM killer)
    attack = ("python3 -c \"\nimport os, time\nfor i in range(3):\n    if os.fork() == 0:\n"
              "        block = b'x' * (300 << 20)\n        time.sleep(3)\n        print('held', i, flush=True)\n"
              "        os._exit(0)\nfor _ in range(3):\n    print('status', os.wait()[1], flush=True)\n\"")
    with make(memory_bytes=512 << 20, command_timeout_s=60) as sandbox:
        sandbox.reset(tasks[0])
        out = sandbox.step(bash(attack)).observation.text
        assert "still here" in sandbox.step(bash("echo still here")).observation.text
    assert out.count("held") <= 1, out


def test_processes_are_counted_per_sandbox(swe_backend):
    make, tasks = swe_backend
    outputs: dict[int, str] = {}

    def hold(i: int, sandbox) -> None:
        # 30 processes at once in each of two sandboxes of the same uid: 60 > 40, but each sandbox has its own 40
        outputs[i] = sandbox.step(bash("for i in $(seq 30); do sleep 3 & done; wait; echo finished")).observation.text

    with make(max_processes=40) as a, make(max_processes=40) as b:
        for sandbox in (a, b):
            sandbox.reset(tasks[0])
        threads = [threading.Thread(target=hold, args=(i, s)) for i, s in enumerate((a, b))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        bomb = a.step(bash("python3 -c \"\nimport os, time\nn = 0\ntry:\n    while True:\n"
                           "        if os.fork() == 0:\n            time.sleep(5)\n            os._exit(0)\n"
                           "        n += 1\nexcept OSError as e:\n    print('fork failed after', n, e.errno)\n\"")
                      ).observation.text
    for text in outputs.values():
        assert "finished" in text and "Resource temporarily unavailable" not in text, text
    forked = int(re.search(r"fork failed after (\d+) 11", bomb).group(1))
    assert forked < 40, bomb


def test_cpu_is_one_budget_for_all_processes(swe_backend):
    make, tasks = swe_backend
    spin = ("python3 -c \"\nimport os, time\nfor i in range(4):\n    if os.fork() == 0:\n"
            "        end = time.time() + 2\n        while time.time() < end:\n            pass\n        os._exit(0)\n"
            "for _ in range(4):\n    os.wait()\nt = os.times()\nprint('cpu', t.children_user + t.children_system)\n\"")
    with make(cpus=0.5, command_timeout_s=60) as sandbox:
        sandbox.reset(tasks[0])
        out = sandbox.step(bash(spin)).observation.text
    used = float(re.search(r"cpu ([\d.]+)", out).group(1))
    assert used < 0.5 * 2 * 1.5, f"4 spinning processes used {used:.2f} CPU-seconds in 2 s under cpus=0.5"


@pytest.mark.parametrize("snapshot_backend", ["overlay", "memory"])
def test_testbed_and_tmp_have_a_size(swe_backend, snapshot_backend):
    make, tasks = swe_backend
    fill = "for i in 1 2 3 4; do head -c 40M /dev/zero > big$i.bin || echo FULL; done; du -sm . | cut -f1"
    with make(disk_bytes=96 << 20, tmp_bytes=32 << 20, snapshot_backend=snapshot_backend) as sandbox:
        sandbox.reset(tasks[0])
        disk = sandbox.step(bash(fill)).observation.text
        tmp = sandbox.step(bash("head -c 64M /dev/zero > /tmp/big.bin || echo TMPFULL; du -sm /tmp")).observation.text
        assert "alive" in sandbox.step(bash("rm -f big*.bin; echo alive")).observation.text
    assert "No space left on device" in disk and "FULL" in disk, disk
    assert "TMPFULL" in tmp, tmp


def test_every_folder_the_agent_can_write_has_a_size(swe_backend):
    """Probe where a command can write at all, then write past the limit of each such folder."""
    make, tasks = swe_backend
    folders = ["/", "/tmp", "/dev", "/dev/shm", "/dev/mqueue", "/run", "/run/bpo", "/run/lock", "/var/tmp", "/home",
               "/root", "/opt", "/srv", "/mnt", "/etc", "/usr", "/testbed"]
    probe = " ".join(f'( : > "{d}/.w" ) 2>/dev/null && rm -f "{d}/.w" && echo "W {d}";' for d in folders)
    fill = {"/testbed": "for i in 1 2; do head -c 60M /dev/zero > big$i.bin || echo FULL; done; rm -f big*.bin",
            "/tmp": "head -c 40M /dev/zero > /tmp/big || echo FULL",
            "/dev/shm": "head -c 40M /dev/zero > /dev/shm/big || echo FULL",
            # message queues: each one reserves its size against the uid's RLIMIT_MSGQUEUE
            "/dev/mqueue": "for i in $(seq 500); do : > /dev/mqueue/q$i || { echo FULL; break; }; done"}
    with make(disk_bytes=96 << 20, tmp_bytes=32 << 20) as sandbox:
        sandbox.reset(tasks[0])
        writable = [line[2:] for line in sandbox.step(bash(probe)).observation.text.splitlines()
                    if line.startswith("W ")]
        assert "/testbed" in writable and "/tmp" in writable, writable
        assert set(writable) <= set(fill), f"a writable folder without a known size: {writable}"
        for folder in writable:
            out = sandbox.step(bash(fill[folder])).observation.text
            assert "FULL" in out, (folder, out)
            assert "alive" in sandbox.step(bash("echo alive")).observation.text


def test_the_bookkeeping_is_out_of_the_agents_reach(swe_backend):
    """Whatever a command does to the sandbox's own bookkeeping (the cwd channel, the shell that runs it, the
    container's keeper, the streams) or however much it writes, the step is an ordinary observation, never a
    ``SandboxCrashed``, and nothing of it lands on the host's disk or in this process's memory."""
    from sandbox_adapters.base import SandboxCrashed

    make, tasks = swe_backend
    attacks = ["rm -rf /run/bpo; ls /run/bpo", "kill -9 $PPID", "kill -9 -1", "kill -9 1; kill -TERM 1",
               "exec 3>&- 2>&-; echo closed", "echo /etc >&3; echo bpo-started >&2; exit 126",
               'head -c 300M /dev/zero >&"$BPO_CWD_FD"; echo flooded', "head -c 300M /dev/zero; echo flooded",
               "kill -STOP $PPID", "echo a\x00b", "echo \ud800"]
    with make(command_timeout_s=5.0) as sandbox:
        sandbox.reset(tasks[0])
        before = _rss_bytes()
        for attack in [*map(bash, attacks), "```write x\x00.py\nx\n```", "```write x.py\na\ud800\n```"]:
            try:
                result = sandbox.step(attack)
            except SandboxCrashed as exc:
                pytest.fail(f"{attack!r} crashed the sandbox: {exc}")
            assert not result.done and result.reward == 0.0, (attack, result)
            after = sandbox.step(bash("pwd; echo alive")).observation.text
            assert "/testbed\nalive" in after, (attack, after)
        grown = _rss_bytes() - before
    assert grown < 64 << 20, f"the floods grew this process by {grown >> 20} MiB"


def test_memory_snapshots_hold_only_what_changed(swe_backend):
    from sandbox_adapters.base import SandboxError

    make, tasks = swe_backend
    with make(snapshot_backend="memory", disk_bytes=512 << 20) as sandbox:
        sandbox.reset(tasks[0])
        pristine = sandbox.snapshot()
        assert not any(isinstance(e[3], bytes) for e in pristine.payload.state.files), "the checkout is not held"
        sandbox.step(bash("python3 -c \"import os; open('blob.bin', 'wb').write(os.urandom(48 << 20))\""))
        before = _rss_bytes()
        snaps = [sandbox.snapshot() for _ in range(6)]
        sandbox.restore(snaps[0])
        snaps.append(sandbox.snapshot())
        grown = _rss_bytes() - before
        for snap in (pristine, *snaps):
            snap.close()
    assert grown < 100 << 20, f"7 snapshots of a 48 MB change grew the process by {grown >> 20} MiB"
    with make(snapshot_backend="memory", max_snapshot_bytes=16 << 20) as sandbox:
        sandbox.reset(tasks[0])
        sandbox.step(bash("head -c 20M /dev/urandom > blob.bin"))
        with pytest.raises(SandboxError, match="max_snapshot_bytes"):
            sandbox.snapshot()


@pytest.mark.timing
def test_close_during_a_running_step_kills_every_process_first(swe_backend):
    make, tasks = swe_backend
    marker = "sleep 387"
    sandbox = make(command_timeout_s=120)
    sandbox.reset(tasks[0])
    workspace = sandbox._workspace.path
    finished = threading.Event()

    def step() -> None:
        try:
            sandbox.step(bash(f"({marker} &) ; {marker} & {marker}"))
        except Exception:
            pass
        finished.set()

    threading.Thread(target=step, daemon=True).start()
    deadline = time.monotonic() + 30
    while len(_processes_running(marker)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_processes_running(marker)) >= 3, "the command did not start"
    start = time.monotonic()
    sandbox.close()
    closed_in = time.monotonic() - start
    assert not _processes_running(marker), "processes of the step outlived close()"
    assert finished.wait(10), "the step did not return after close()"
    assert not os.path.exists(workspace)
    assert closed_in < 15, f"close() took {closed_in:.1f} s"
    from sandbox_adapters.swebench.docker import CONTAINER_LABEL, idle_containers

    containers = subprocess.run(["docker", "ps", "--format", "{{.Names}}", "--filter",
                                 f"label={CONTAINER_LABEL}={os.getpid()}"], capture_output=True, text=True)
    if containers.returncode == 0:  # the Docker backend: only clean containers, kept for reuse, are left running
        assert not set(containers.stdout.split()) - set(idle_containers())
