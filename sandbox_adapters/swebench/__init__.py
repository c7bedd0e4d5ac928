"""SWE-bench: a repository sandbox graded by the real ``swebench`` code.

``sandbox`` (the adapter), ``confine`` (bubblewrap confinement of each command), ``docker`` (the same commands in
an instance's Docker image), ``limits`` (one memory, process, CPU and disk budget per sandbox), ``workspace``
(overlayfs / in-memory snapshots of the repository), ``protected`` (which agent-written files grading ignores),
``grading`` (``make_test_spec`` + ``get_eval_report``), ``verified`` (classic SWE-bench rows, e.g. SWE-bench
Verified as published, completed to the SWE-bench 5 schema) and ``tasks`` (a generator of small SWE-bench-style
tasks).
"""

from sandbox_adapters.swebench.sandbox import SWEBenchSandbox, normalise_output, parse_swe_action

__all__ = ["SWEBenchSandbox", "normalise_output", "parse_swe_action"]
