"""Classic SWE-bench rows (SWE-bench Verified as published, 13 fields): derived grading fields, refusals, and a
Verified-format instance of a real repository graded end to end (prepare, then the sandbox: empty patch 0, gold 1).

The repository is ``psf/requests``, built locally without network from the copy installed with ``swebench`` (a
dependency of it): its package in a git repository laid out as requests' own (``requests/``, ``tests/``), tests in
the style of requests' ``tests/test_utils.py``, then a commit that stops ``_parse_content_type_header`` from
lower-casing parameter names (the instance's ``base_commit``). The gold patch restores the line; the test patch
adds a test of ``Charset=``/``CHARSET=`` headers. The row has exactly the published Verified fields.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from sandbox_adapters.swebench.confine import bwrap_path
from sandbox_adapters.swebench.grading import swebench_available
from sandbox_adapters.swebench.verified import CLASSIC_FIELDS, complete_instance

pytestmark = [
    pytest.mark.skipif(not swebench_available(), reason="the `swebench` package (envs extra) is not installed"),
]
needs_bwrap = pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap is not installed (apt-get install "
                                 "bubblewrap); the local SWE sandbox confines every command with it")

# `slow` (outside the fast tier): preparing and grading the row in a sandbox; the fast tier keeps the row checks.
INSTANCE_ID = "psf__requests-90001"
VERIFIED_FIELDS = (*CLASSIC_FIELDS, "difficulty")
_GIT_ENV = {"GIT_AUTHOR_NAME": "bpo-tests", "GIT_AUTHOR_EMAIL": "tests@bpo.invalid", "GIT_COMMITTER_NAME": "bpo-tests",
            "GIT_COMMITTER_EMAIL": "tests@bpo.invalid", "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+0000",
            "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+0000", "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null"}

_FIXED_LINE = "params_dict[key.lower()] = value"
_BUGGY_LINE = "params_dict[key] = value"

_OLD_TESTS = '''import pytest

from requests.structures import CaseInsensitiveDict
from requests.utils import (
    _parse_content_type_header,
    get_encoding_from_headers,
    parse_header_links,
)


@pytest.mark.parametrize(
    "value, expected",
    (
        ("application/xml", ("application/xml", {})),
        ("application/json ; charset=utf-8", ("application/json", {"charset": "utf-8"})),
        ('text/plain; charset="utf-8"', ("text/plain", {"charset": "utf-8"})),
    ),
    ids=["no-parameters", "spaces", "quoted"],
)
def test__parse_content_type_header(value, expected):
    assert _parse_content_type_header(value) == expected


@pytest.mark.parametrize(
    "value, expected",
    (
        (CaseInsensitiveDict(), None),
        (CaseInsensitiveDict({"content-type": "application/json; charset=utf-8"}), "utf-8"),
        (CaseInsensitiveDict({"content-type": "text/plain"}), "ISO-8859-1"),
    ),
    ids=["none", "charset", "text-default"],
)
def test_get_encoding_from_headers(value, expected):
    assert get_encoding_from_headers(value) == expected


def test_parse_header_links():
    links = parse_header_links('<http://example.com/front.jpeg>; rel=front; type="image/jpeg"')
    assert links == [{"url": "http://example.com/front.jpeg", "rel": "front", "type": "image/jpeg"}]
'''

_NEW_TESTS = '''

@pytest.mark.parametrize(
    "header",
    ("text/html; Charset=UTF-8", "text/html; CHARSET=UTF-8"),
    ids=["title-case", "upper-case"],
)
def test_get_encoding_from_headers_parameter_name_case(header):
    headers = CaseInsensitiveDict({"content-type": header})
    assert get_encoding_from_headers(headers) == "UTF-8"
'''

_ISSUE = """Charset parameter ignored when its name is not lower case

Parameter names of a Content-Type header are case-insensitive (RFC 9110 section 8.3.1), but since the last
release `requests` ignores `Charset=UTF-8`:

```python
>>> requests.utils.get_encoding_from_headers({"content-type": "text/html; Charset=UTF-8"})
'ISO-8859-1'
```

`charset=UTF-8` gives `'UTF-8'` as expected.
"""


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, env={**os.environ, **_GIT_ENV}, check=True, capture_output=True,
                          text=True).stdout


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def build_requests_instance(out_dir: str) -> dict:
    """Write ``out_dir/repos/<id>`` (a git repository of the installed requests) and ``out_dir/instances.jsonl``
    (one Verified-format row); return the row."""
    import requests

    source = os.path.dirname(requests.__file__)
    with open(os.path.join(source, "utils.py")) as f:
        utils = f.read()
    if utils.count(_FIXED_LINE) != 1:
        pytest.skip(f"the installed requests {requests.__version__} has no single {_FIXED_LINE!r} line to break")
    repo = os.path.join(out_dir, "repos", INSTANCE_ID)
    shutil.copytree(source, os.path.join(repo, "requests"), ignore=shutil.ignore_patterns("__pycache__"))
    _write(os.path.join(repo, "tests", "__init__.py"), "")
    _write(os.path.join(repo, "tests", "test_utils.py"), _OLD_TESTS)
    _write(os.path.join(repo, ".gitignore"), "__pycache__/\n*.py[cod]\n.pytest_cache/\n*.egg-info/\n")
    _write(os.path.join(repo, "README.md"), f"# Requests\n\nrequests {requests.__version__}, for grading tests.\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"requests {requests.__version__}")
    utils_path = os.path.join(repo, "requests", "utils.py")
    _write(utils_path, utils.replace(_FIXED_LINE, _BUGGY_LINE))
    _git(repo, "commit", "-q", "-am", "Simplify content type parameter parsing")
    base_commit = _git(repo, "rev-parse", "HEAD").strip()
    _write(utils_path, utils)
    patch = _git(repo, "diff", "--no-color")
    _git(repo, "checkout", "-q", "--", "requests/utils.py")
    _write(os.path.join(repo, "tests", "test_utils.py"), _OLD_TESTS + _NEW_TESTS)
    test_patch = _git(repo, "diff", "--no-color")
    _git(repo, "checkout", "-q", "--", "tests/test_utils.py")
    test_file = "tests/test_utils.py"
    pass_to_pass = ([f"{test_file}::test__parse_content_type_header[{i}]" for i in ("no-parameters", "spaces",
                                                                                      "quoted")]
                    + [f"{test_file}::test_get_encoding_from_headers[{i}]" for i in ("none", "charset",
                                                                                     "text-default")]
                    + [f"{test_file}::test_parse_header_links"])
    row = {
        "repo": "psf/requests",
        "instance_id": INSTANCE_ID,
        "base_commit": base_commit,
        "patch": patch,
        "test_patch": test_patch,
        "problem_statement": _ISSUE,
        "hints_text": "",
        "created_at": "2024-01-01T00:00:00Z",
        "version": "2.31",
        "FAIL_TO_PASS": json.dumps([f"{test_file}::test_get_encoding_from_headers_parameter_name_case[{i}]"
                                    for i in ("title-case", "upper-case")]),
        "PASS_TO_PASS": json.dumps(pass_to_pass),
        "environment_setup_commit": base_commit,
        "difficulty": "<15 min fix",
    }
    assert set(row) == set(VERIFIED_FIELDS)
    with open(os.path.join(out_dir, "instances.jsonl"), "w") as f:
        f.write(json.dumps(row) + "\n")
    return row


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """``(out_dir, row)``: the Verified-format instance of requests and its repository under ``out_dir/repos``."""
    out = tmp_path_factory.mktemp("swe_verified")
    return str(out), build_requests_instance(str(out))


def _sandbox(**overrides):
    from sandbox_adapters.swebench import SWEBenchSandbox

    return SWEBenchSandbox(SWEBenchSandbox.Config(**overrides))


def _episode(box, task, patch: str | None) -> tuple[float, dict]:
    """Reset on ``task``, apply ``patch`` (None: no change) with git, submit; the reward and the final info."""
    box.reset(task)
    if patch:
        result = box.step(f"```bash\ngit apply <<'EOF_PATCH'\n{patch}EOF_PATCH\n```")
        assert "[exit code 0]" in result.observation.text, result.observation.text
    result = box.step("submit")
    assert result.done
    return result.reward, result.info


# ---------------------------------------------------------------------------------------------------------------
# derived fields and refusals


def test_classic_row_lacks_what_make_test_spec_reads(verified):
    from swebench.harness.utils import make_test_spec

    _, row = verified
    with pytest.raises(KeyError):
        make_test_spec(row)  # what a classic row hit at its first submit
    spec = make_test_spec(complete_instance(row))
    assert spec.FAIL_TO_PASS == json.loads(row["FAIL_TO_PASS"])


def test_derived_fields(verified):
    _, row = verified
    docker = complete_instance(row)
    assert {k: docker[k] for k in row} == row  # published fields untouched
    assert docker["log_parser"] == "parse_log_requests"
    assert docker["eval_type"] == "pass_and_fail"
    assert docker["image"] == "swebench/sweb.eval.x86_64.psf_1776_requests-90001:latest"
    script = docker["eval_script"]
    lines = script.splitlines()
    assert lines[:2] == ["#!/bin/bash", "set -uxo pipefail"]
    assert lines[lines.index(": '>>>>> Start Test Output'") + 1] == "pytest -rA tests/test_utils.py"
    assert "conda activate testbed" in lines and "python -m pip install ." in lines
    assert lines.count(f"git checkout {row['base_commit']} tests/test_utils.py") == 2
    assert row["test_patch"].rstrip("\n") in script
    local = complete_instance(row, setup=False)["eval_script"]
    assert "conda" not in local and "pip install" not in local
    assert [line for line in lines if "conda" not in line and "pip install" not in line] == local.splitlines()
    # a row of the SWE-bench 5 schema passes through as it is
    assert complete_instance(docker, setup=False) == docker


def test_django_directives_are_test_modules():
    from sandbox_adapters.swebench.verified import test_directives

    patch = ("diff --git a/tests/forms_tests/tests/test_forms.py b/tests/forms_tests/tests/test_forms.py\n"
             "diff --git a/tests/forms_tests/data.json b/tests/forms_tests/data.json\n")
    assert test_directives("django/django", patch) == ["forms_tests.tests.test_forms"]
    assert test_directives("pallets/flask", patch) == ["tests/forms_tests/tests/test_forms.py"]


@pytest.mark.parametrize("change, field", [
    ({"version": None}, "'version'"),
    ({"FAIL_TO_PASS": None}, "'FAIL_TO_PASS'"),
    ({"problem_statement": None}, "'problem_statement'"),
    ({"test_patch": None}, "'test_patch'"),
    ({"version": "9.99"}, "version '9.99'"),
    ({"repo": "example/unknown"}, "repo 'example/unknown'"),
    ({"version": 2.31}, "'version' must be a string"),
    ({"PASS_TO_PASS": "tests/test_utils.py::test_parse_header_links"}, "PASS_TO_PASS is not a JSON list"),
])
def test_refusals_name_the_field(verified, change, field):
    _, row = verified
    bad = {k: v for k, v in {**row, **change}.items() if v is not None}
    with pytest.raises(ValueError, match="swebench: instance") as info:
        complete_instance(bad)
    assert field in str(info.value)


def test_prepare_refuses_a_row_without_version(verified, tmp_path):
    from verl_bpo.data.prepare import main

    out_dir, row = verified
    path = tmp_path / "instances.jsonl"
    path.write_text(json.dumps({k: v for k, v in row.items() if k != "version"}) + "\n")
    with pytest.raises(SystemExit) as info:
        main(["swebench", "--out", str(tmp_path / "data"), "--no-render", "--train-instances", str(path),
              "--train-repos-dir", os.path.join(out_dir, "repos"), "--val-instances", str(path),
              "--val-repos-dir", os.path.join(out_dir, "repos")])
    assert "'version'" in str(info.value) and INSTANCE_ID in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# end to end, local backend


@pytest.mark.slow
@pytest.mark.timing
@needs_bwrap
def test_prepare_then_grade_locally(verified, tmp_path):
    """``prepare`` completes the row; the sandbox grades the empty patch 0 and the gold patch 1."""
    import pandas as pd

    from verl_bpo.data.prepare import main

    out_dir, row = verified
    path = os.path.join(out_dir, "instances.jsonl")
    written = main(["swebench", "--out", str(tmp_path / "data"), "--train-instances", path, "--val-instances", path])
    extra = pd.read_parquet(written["train"]).iloc[0]["extra_info"]
    task = extra["task"] if isinstance(extra["task"], dict) else json.loads(extra["task"])
    assert task["instance_id"] == INSTANCE_ID and "conda" not in task["eval_script"]
    with _sandbox() as box:
        started = time.monotonic()
        empty, info = _episode(box, task, None)
        # unresolved because the new tests fail, while the old ones ran and pass
        assert empty == 0.0 and info["fail_to_pass_failures"] == 2 and info["pass_to_pass_failures"] == 0, info
        gold, info = _episode(box, task, row["patch"])
        assert gold == 1.0, info
        assert info["fail_to_pass_failures"] == 0 and info["pass_to_pass_failures"] == 0
        assert time.monotonic() - started < 120


@pytest.mark.slow
@needs_bwrap
def test_sandbox_completes_a_classic_row(verified):
    """A classic row that did not come through ``prepare`` is completed at reset; a bad one is refused there."""
    out_dir, row = verified
    task = {**row, "repo_path": os.path.join(out_dir, "repos", INSTANCE_ID)}
    with _sandbox() as box:
        empty, info = _episode(box, task, None)
        assert empty == 0.0 and info["fail_to_pass_failures"] == 2, info
        gold, info = _episode(box, task, row["patch"])
        assert gold == 1.0, info
        with pytest.raises(ValueError, match="'version'"):
            box.reset({k: v for k, v in task.items() if k != "version"})


# ---------------------------------------------------------------------------------------------------------------
# end to end, Docker backend: the instance image is the SWE base image (python3, git, pytest; no conda, no pip)
# with requests' runtime dependencies, and the repository at /testbed


def _requests_dependencies_image(base_image: str) -> str:
    """``base_image`` with urllib3, idna and certifi (pure Python) copied from this interpreter; no network."""
    import tempfile

    import certifi
    import idna
    import urllib3

    modules = (urllib3, idna, certifi)
    tag = "bpo-local/requests-deps:" + "-".join(m.__version__ for m in modules).replace("+", "_")
    if subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode == 0:
        return tag
    with tempfile.TemporaryDirectory(prefix="bpo-requests-deps-") as context:
        for module in modules:
            shutil.copytree(os.path.dirname(module.__file__), os.path.join(context, "deps", module.__name__),
                            ignore=shutil.ignore_patterns("__pycache__"))
        _write(os.path.join(context, "Dockerfile"),
               f"FROM {base_image}\nCOPY deps /tmp/deps\n"
               "RUN site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])') && "
               "mkdir -p \"$site\" && cp -r /tmp/deps/* \"$site\"/ && rm -rf /tmp/deps\n")
        subprocess.run(["docker", "build", "--network", "none", "-q", "-t", tag, context], check=True,
                       capture_output=True, timeout=600)
    return tag


@pytest.fixture(scope="module")
def verified_image(verified, tmp_path_factory):
    """The instance's image, named as the harness names it in namespace ``bpo-local``, and a testbed cache."""
    from swebench.task.checks import expected_image

    from sandbox_adapters.swebench.docker import build_instance_image
    from tests.sandboxes.conftest import BASE_IMAGE, docker_skip_reason

    reason = docker_skip_reason()
    if reason:
        pytest.skip(reason)
    out_dir, _ = verified
    image = expected_image(INSTANCE_ID, "bpo-local")
    # the repository follows the installed requests, so an image left from an earlier run may be stale
    subprocess.run(["docker", "image", "rm", "-f", image], capture_output=True)
    build_instance_image(image, os.path.join(out_dir, "repos", INSTANCE_ID), _requests_dependencies_image(BASE_IMAGE))
    return image, str(tmp_path_factory.mktemp("swe_verified_testbeds"))


@pytest.mark.slow
def test_prepare_then_grade_in_docker(verified, verified_image, tmp_path):
    """``prepare --backend docker`` derives SWE-bench's own script (conda steps included, which fail softly in an
    image without conda); the sandbox grades the empty patch 0 and the gold patch 1 in the instance's image."""
    import pandas as pd

    from verl_bpo.data.prepare import main

    out_dir, row = verified
    image, cache = verified_image
    path = os.path.join(out_dir, "instances.jsonl")
    written = main(["swebench", "--out", str(tmp_path / "data"), "--backend", "docker", "--image-namespace",
                    "bpo-local", "--sandbox-config", f"docker_cache_dir={cache}", "--train-instances", path,
                    "--val-instances", path])
    extra = pd.read_parquet(written["val"]).iloc[0]["extra_info"]
    task = extra["task"] if isinstance(extra["task"], dict) else json.loads(extra["task"])
    assert task["image"] == image and "conda activate testbed" in task["eval_script"]
    with _sandbox(backend="docker", docker_cache_dir=cache) as box:
        empty, info = _episode(box, task, None)
        assert empty == 0.0 and info["fail_to_pass_failures"] == 2 and info["pass_to_pass_failures"] == 0, info
        gold, info = _episode(box, task, row["patch"])
        assert gold == 1.0, info
