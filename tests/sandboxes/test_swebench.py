"""SWE sandbox: conformance on both snapshot backends, confinement, real SWE-bench grading, the task generator."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import socket
import subprocess
import tempfile
import time

import pytest

from sandbox_adapters.registry import make_sandbox
from sandbox_adapters.swebench.confine import bwrap_path
from sandbox_adapters.swebench.grading import swebench_available
from sandbox_adapters.swebench.tasks import BUG_KINDS, generate_tasks
from sandbox_adapters.swebench.workspace import overlay_supported
from tests.sandboxes.conformance import SandboxConformance

pytestmark = pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap is not installed (apt-get install "
                                "bubblewrap); the SWE sandbox confines every command with it")
needs_swebench = pytest.mark.skipif(not swebench_available(), reason="the `swebench` package (envs extra) is "
                                    "not installed; grading uses its real code")
needs_overlay = pytest.mark.skipif(not overlay_supported(), reason="this process cannot mount overlayfs (needs root)")
# `slow` (outside the fast tier): the conformance suites, grading (a pytest run per grade) and the runaway
# commands that run into their limits; the fast tier keeps the confinement checks.


@pytest.fixture(scope="module")
def tasks(swe_tasks):
    return swe_tasks


def bash(cmd: str) -> str:
    return f"I will run this.\n```bash\n{cmd}\n```"


def _sandbox(backend="auto", **overrides):
    from sandbox_adapters.swebench import SWEBenchSandbox

    return SWEBenchSandbox(SWEBenchSandbox.Config(snapshot_backend=backend, **overrides))


def _uid_processes(uid: int) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                pids.append(int(pid))
        except FileNotFoundError:
            pass
    return pids


def _tree_digest(root: str) -> str:
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            digest.update(path.encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# conformance (the probe submits, so grading — and thus swebench — is part of every transcript)


class SWEConformanceHooks(SandboxConformance):
    """The conformance hooks of the SWE sandbox, for every backend (``make_sandbox`` comes from the subclass)."""

    sampler_step_timeout_s = 10.0  # a submit grades with pytest in a fresh sandbox (~1 s locally, ~2 s in Docker)

    def task(self):
        return self._the_task

    def prefix_actions(self):
        # a cd (the cwd is state) and a file write (the directory is state)
        return [bash("cd pkg0 && ls"), bash("sed -i 's/len(values) - size)/len(values) - size + 1)/' windows.py")]

    def probe_actions(self):
        return [bash("pwd; cat windows.py; echo note >> ../notes.txt"), bash("cat /testbed/notes.txt"), "submit"]

    def other_action(self):
        return bash("rm windows.py && ls")

    def inject_step_crash(self, sandbox):
        def broken(*args, **kwargs):
            raise OSError("the sandbox runtime died")

        sandbox._runner.run = broken


@pytest.mark.slow
@pytest.mark.envs
@needs_swebench
class TestSWEMemoryConformance(SWEConformanceHooks):
    backend = "memory"

    @pytest.fixture(autouse=True)
    def _task(self, tasks):
        self._the_task = tasks[0]  # off_by_one in pkg0/windows.py

    def make_sandbox(self):
        return _sandbox(self.backend)


@needs_overlay
class TestSWEOverlayConformance(TestSWEMemoryConformance):
    backend = "overlay"


# ---------------------------------------------------------------------------------------------------------------
# the agent-facing behaviour


def test_registry_builds_the_swe_sandbox():
    sandbox = make_sandbox("swebench", {"snapshot_backend": "memory", "max_steps": 3})
    assert type(sandbox).__name__ == "SWEBenchSandbox" and sandbox.config.max_steps == 3
    with pytest.raises(ValueError, match="snapshot_backend"):
        make_sandbox("swebench", {"snapshot_backend": "zfs"})


def test_action_format():
    from sandbox_adapters.swebench import parse_swe_action

    assert json.loads(parse_swe_action("Let me look.\n```bash\nls -la\n```\nthen more")) == ["bash", "ls -la"]
    assert json.loads(parse_swe_action("```sh\necho a\necho b\n```")) == ["bash", "echo a\necho b"]
    assert json.loads(parse_swe_action("```write pkg/a.py\nx = 1\n```")) == ["write", "pkg/a.py", "x = 1\n"]
    assert json.loads(parse_swe_action("All tests pass now.\nsubmit")) == ["submit"]
    assert json.loads(parse_swe_action("```bash\nsubmit\n```")) == ["submit"]
    assert parse_swe_action("```python\nprint(1)\n```") is None
    assert parse_swe_action("I think I should submit the fix later.") is None
    assert parse_swe_action("```bash\n   \n```") is None


def test_cwd_persists_but_shell_state_does_not(tasks):
    with _sandbox() as sandbox:
        sandbox.reset(tasks[0])
        sandbox.step(bash("cd tests && export FOO=1"))
        out = sandbox.step(bash("pwd; echo FOO=${FOO:-unset}")).observation.text
        assert "/testbed/tests\nFOO=unset" in out
        out = sandbox.step("```write ../pkg0/new.py\nVALUE = 3\n```").observation.text
        assert "Wrote 10 bytes" in out
        assert "VALUE = 3" in sandbox.step(bash("cat /testbed/pkg0/new.py")).observation.text


@pytest.mark.slow
def test_timing_strings_and_addresses_are_normalised(tasks):
    from sandbox_adapters.swebench import normalise_output

    assert normalise_output("=== 3 passed in 0.51s ===") == "=== 3 passed in <T>s ==="
    assert normalise_output("Ran 2 tests in 0.001s") == "Ran 2 tests in <T>s"
    assert normalise_output("real\t0m0.003s") == "real\t<T>"
    assert normalise_output("<Foo object at 0x7f3a2b1c9d80>") == "<Foo object at 0x<addr>>"
    assert normalise_output("took 12.5 ms at 2024-05-01 10:11:12.123") == "took <T> at <timestamp>"
    with _sandbox() as a, _sandbox() as b:
        outs = []
        for sandbox in (a, b):
            sandbox.reset(tasks[0])
            cmd = "python -m pytest -q tests; python -c 'import time; t=time.time(); print(object())'; time true"
            outs.append(sandbox.step(bash(cmd)).observation.text)
        assert "passed in <T>s" in outs[0] and "0x<addr>" in outs[0]
        assert outs[0] == outs[1]


# ---------------------------------------------------------------------------------------------------------------
# confinement


def test_no_network(tasks):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        with _sandbox() as sandbox:
            sandbox.reset(tasks[0])
            probe = (f"import socket\nfor addr in [('127.0.0.1', {port}), ('1.1.1.1', 80)]:\n"
                     "    try:\n        socket.create_connection(addr, timeout=2); print('CONNECTED', addr)\n"
                     "    except OSError as e:\n        print('FAILED', addr, e.errno)\n")
            out = sandbox.step(f"```write probe.py\n{probe}```").observation.text
            assert "Wrote" in out
            out = sandbox.step(bash("python probe.py")).observation.text
        assert "CONNECTED" not in out and out.count("FAILED") == 2, out
        with pytest.raises(socket.timeout):  # nothing reached the host's loopback listener
            listener.accept()
    finally:
        listener.close()


def test_writes_outside_the_sandbox_fail_and_the_host_is_untouched(tasks, tmp_path):
    repo_before = _tree_digest(tasks[0]["repo_path"])
    host_file = tmp_path / "host.txt"
    host_file.write_text("original")
    targets = ["/etc/bpo_probe", "/work/bpo_probe", "/usr/local/bpo_probe", str(host_file)]
    with _sandbox() as sandbox:
        sandbox.reset(tasks[0])
        cmd = "; ".join(f"echo pwned > {t}" for t in targets)
        out = sandbox.step(bash(cmd)).observation.text
        # system directories are read-only; the rest of the host is absent inside, or (on the way to the interpreter,
        # which depends on where the venv is) not writable for the sandbox user; /tmp is a private tmpfs
        refusals = ("Read-only file system", "No such file or directory", "Permission denied")
        for target in targets:
            assert any(f"{target}: {refusal}" in out for refusal in refusals), out
        assert "/etc/bpo_probe: Read-only file system" in out and "/usr/local/bpo_probe: Read-only file system" in out
        assert f"{host_file}: No such file or directory" in out, out
        # the agent's own edits, commits and deletions stay inside the sandbox
        sandbox.step(bash("echo change >> README.md && git add -A && git commit -qm x && rm -rf tests && ls"))
        sandbox.step(bash("rm -rf /testbed/.git"))
    for target in targets[:3]:
        assert not os.path.exists(target)
    assert host_file.read_text() == "original"
    assert _tree_digest(tasks[0]["repo_path"]) == repo_before


def test_the_host_is_invisible_but_the_interpreter_works(tasks):
    with _sandbox() as sandbox:
        sandbox.reset(tasks[0])
        # this test file, the task data (gold patches) and home directories cannot be read from inside
        out = sandbox.step(bash(f"cat {os.path.abspath(__file__)}; cat {tasks[0]['repo_path']}/README.md; "
                                "ls /home; python -c 'import pytest; print(\"pytest ok\")'")).observation.text
    assert out.count("No such file or directory") == 3, out
    assert "pytest ok" in out and "def test_" not in out


def test_memory_hog_is_stopped(tasks):
    with _sandbox(memory_bytes=512 << 20) as sandbox:
        sandbox.reset(tasks[0])
        result = sandbox.step(bash("python -c 'b = bytearray(2 << 30); print(\"ALLOCATED\")'"))
    assert "MemoryError" in result.observation.text and "ALLOCATED" not in result.observation.text


@pytest.mark.slow
@pytest.mark.timing
def test_infinite_loop_is_killed_and_the_sandbox_goes_on(tasks):
    with _sandbox(command_timeout_s=1.5) as sandbox:
        sandbox.reset(tasks[0])
        start = time.monotonic()
        result = sandbox.step(bash("sleep 1000 & while true; do :; done"))
        assert time.monotonic() - start < 10
        assert result.info.get("timed_out") and "timed out" in result.observation.text
        assert not result.done
        assert "still here" in sandbox.step(bash("echo still here")).observation.text


@pytest.mark.slow
@pytest.mark.timing
@pytest.mark.skipif(os.geteuid() != 0, reason="the process limit only binds a dedicated uid when run as root")
def test_fork_bomb_is_contained(tasks):
    uid = 64_999  # a uid of its own, so that no other sandbox's processes count here
    assert not _uid_processes(uid), "processes of the test uid exist before the test"
    with _sandbox(command_timeout_s=3.0, max_processes=32, sandbox_uid=uid) as sandbox:
        sandbox.reset(tasks[0])
        start = time.monotonic()
        result = sandbox.step(bash(":(){ :|:& };:; sleep 2"))  # the sleep keeps the bomb running a while
        assert time.monotonic() - start < 15
        text = result.observation.text
        assert "Resource temporarily unavailable" in text or result.info.get("timed_out"), text
        assert "alive" in sandbox.step(bash("echo alive")).observation.text
    deadline = time.monotonic() + 5
    while _uid_processes(uid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _uid_processes(uid), "fork-bomb processes survived the step"


@pytest.mark.slow
@pytest.mark.parametrize("backend", [pytest.param("overlay", marks=needs_overlay), "memory"])
def test_a_dropped_sandbox_cleans_up_after_itself(tasks, tmp_path, monkeypatch, backend):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sandbox = _sandbox(backend)
    sandbox.reset(tasks[0])
    sandbox.step(bash("echo x > new.txt"))
    assert os.listdir(tmp_path)
    del sandbox  # never closed: the finalizer must unmount and delete
    gc.collect()
    assert not os.listdir(tmp_path)
    with open("/proc/mounts") as f:
        assert str(tmp_path) not in f.read()


def test_memory_restore_undoes_adversarial_changes_in_place(tmp_path):
    from sandbox_adapters.swebench.workspace import MemoryWorkspace, _scan, make_layer

    src = tmp_path / "src"
    (src / "d" / "e").mkdir(parents=True)
    (src / "d" / "e" / "f.txt").write_text("hello")
    (src / "a").write_text("A")
    (src / "b").write_text("B")
    os.chmod(src / "b", 0o755)
    os.symlink("a", src / "lnk")
    origin = make_layer(str(src), None).acquire()
    workspace = MemoryWorkspace(None)
    try:
        workspace.load(origin)
        ws = tmp_path / "ws"
        os.symlink(workspace.path, ws)
        (ws / "a").write_text("changed")  # a change the snapshot must hold
        snap = workspace.snapshot()
        expected = {p: (k, m, d if k != "file" else (ws / p).read_bytes()) for p, (k, m, d) in _scan(str(ws)).items()}
        kept_inode = os.stat(ws / "d" / "e" / "f.txt").st_ino
        # a directory turned into a symlink to the host, a hard link, a mode change, a fifo, a new file, a link -> dir
        os.rename(ws / "d", tmp_path / "moved")
        os.symlink(str(tmp_path / "moved"), ws / "d")
        os.unlink(ws / "b")
        os.link(ws / "a", ws / "b")
        os.chmod(ws / "a", 0o600)
        os.mkfifo(ws / "fifo")
        (ws / "new").write_text("N")
        os.unlink(ws / "lnk")
        (ws / "lnk").mkdir()
        workspace.restore(snap)
        now = {p: (k, m, d if k != "file" else (ws / p).read_bytes()) for p, (k, m, d) in _scan(str(ws)).items()}
        assert now == expected
        assert (ws / "a").read_text() == "changed" and (ws / "b").read_text() == "B"
        assert all(detail[4] == 1 for kind, _, detail in _scan(str(ws)).values() if kind == "file")  # no hard links
        assert (tmp_path / "moved" / "e" / "f.txt").read_text() == "hello"  # nothing written through the symlink
        assert os.stat(tmp_path / "moved" / "e" / "f.txt").st_ino == kept_inode
        unchanged = os.stat(ws / "d" / "e" / "f.txt").st_ino
        workspace.restore(snap)
        assert os.stat(ws / "d" / "e" / "f.txt").st_ino == unchanged  # equal files are not rewritten
        snap.release()
    finally:
        workspace.close()
        origin.release()


def test_memory_snapshot_keeps_symlinks_as_links(tasks):
    with _sandbox("memory") as sandbox:
        sandbox.reset(tasks[0])
        sandbox.step(bash("ln -s /etc/hostname leak"))
        snap = sandbox.snapshot()
        try:
            sandbox.step(bash("rm leak"))
            sandbox.restore(snap)
            out = sandbox.step(bash("readlink leak; test -L leak && echo IS_LINK")).observation.text
        finally:
            snap.close()
    assert "/etc/hostname\nIS_LINK" in out


@pytest.mark.slow
@needs_overlay
def test_overlay_flattens_deep_stacks_exactly(tasks):
    with _sandbox("overlay", max_layers=2) as sandbox:
        sandbox.reset(tasks[0])
        snaps = []
        for i in range(5):
            sandbox.step(bash(f"echo {i} >> log.txt && rm -f gone{i - 1}.txt && touch gone{i}.txt"))
            snaps.append(sandbox.snapshot())
            assert len(sandbox._workspace._stack) <= 3
        try:
            for i, snap in enumerate(snaps):
                sandbox.restore(snap)
                out = sandbox.step(bash("cat log.txt; ls gone*")).observation.text
                assert out.startswith("\n".join(str(k) for k in range(i + 1)) + f"\ngone{i}.txt\n"), out
        finally:
            for snap in snaps:
                snap.close()


# ---------------------------------------------------------------------------------------------------------------
# grading with the real swebench code, and the generator


@pytest.mark.envs
@needs_swebench
def test_generated_instances_load_with_swebench(tasks, tmp_path):
    from swebench.harness.utils import load_swebench_dataset

    from sandbox_adapters.swebench.tasks import load_tasks

    out = tmp_path / "again"
    generate_tasks(str(out), num=len(BUG_KINDS), seed=0)
    loaded = load_tasks(str(out / "instances.jsonl"))
    assert [t["instance_id"] for t in loaded] == [t["instance_id"] for t in tasks]
    assert {t["bug_kind"] for t in loaded} == set(BUG_KINDS)
    # deterministic: same instances (commits included) for the same seed
    assert [t["base_commit"] for t in loaded] == [t["base_commit"] for t in tasks]
    assert load_swebench_dataset(str(out / "instances.jsonl"))[0]["patch"] == tasks[0]["patch"]
    for task in loaded:
        assert json.loads(task["FAIL_TO_PASS"]) and os.path.isdir(os.path.join(task["repo_path"], ".git"))
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=task["repo_path"], capture_output=True, text=True)
        assert head.stdout.strip() == task["base_commit"]


@pytest.mark.slow
@pytest.mark.envs
@needs_swebench
def test_grading_empty_patch_unresolved_gold_resolved(tasks):
    with _sandbox() as sandbox:
        for task in tasks:
            sandbox.reset(task)
            result = sandbox.step("submit")
            assert result.done and result.reward == 0.0 and not result.info["resolved"], (task["instance_id"], result)
            assert result.info["fail_to_pass_failures"] >= 1
            sandbox.reset(task)
            applied = sandbox.step(bash(f"git apply <<'EOF'\n{task['patch']}EOF\ngit status --short"))
            assert "[exit code 0]" in applied.observation.text
            result = sandbox.step("I fixed it.\nsubmit")
            assert result.done and result.reward == 1.0 and result.info["resolved"], (task["instance_id"], result)


@pytest.mark.slow
@pytest.mark.envs
@needs_swebench
def test_breaking_a_passing_test_or_step_limit_is_unresolved(tasks):
    task = tasks[0]
    with _sandbox(max_steps=2) as sandbox:
        sandbox.reset(task)
        sandbox.step(bash(f"git apply <<'EOF'\n{task['patch']}EOF"))
        # the fix is in, but the agent also breaks the function for the PASS_TO_PASS case
        result = sandbox.step(bash("sed -i 's/return \\[/return [0] + [/' pkg0/windows.py"))
    assert result.done and result.info["step_limit"] and result.reward == 0.0
    assert result.info["pass_to_pass_failures"] == 1


@pytest.mark.slow
@pytest.mark.envs
@needs_swebench
def test_invalid_turns_count_towards_the_step_limit(tasks):
    with _sandbox(max_steps=2) as sandbox:
        sandbox.reset(tasks[2])
        first = sandbox.step("Let me think about this.")
        assert first.info["invalid_action"] and not first.done
        last = sandbox.step("```python\nprint('not a shell block')\n```")
    assert last.done and last.reward == 0.0 and last.info["step_limit"] and last.info["invalid_action"]
    assert last.info["fail_to_pass_failures"] == 1


@pytest.mark.slow
@pytest.mark.envs
@needs_swebench
def test_branches_graded_independently(tasks):
    task = tasks[1]
    with _sandbox() as parent, _sandbox() as child:
        parent.reset(task)
        parent.step(bash("cat pkg1/ages.py"))
        snap = parent.snapshot()
        try:
            child.restore(snap)
            fixed = child.step(bash("sed -i 's/age > ADULT_AGE/age >= ADULT_AGE/' pkg1/ages.py"))
            assert "[exit code 0]" in fixed.observation.text
            assert child.step("submit").reward == 1.0
            assert parent.step("submit").reward == 0.0
            child.restore(snap)  # the fork point again: the fix is gone
            assert child.step("submit").reward == 0.0
        finally:
            snap.close()
