"""The full test run (scripts/test.sh) runs tests/e2e in a pytest of its own beside the other tests and stops it
with SIGTERM when the run is interrupted. SIGTERM becomes KeyboardInterrupt here, as Ctrl-C would, so that every
trainer a test started is still stopped with its whole session (``cpu_launch.run_trainer``'s cleanup)."""

import signal

signal.signal(signal.SIGTERM, signal.default_int_handler)
