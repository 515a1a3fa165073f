"""Loaded by every Python process whose path starts here (``make test-cpu``): where ``SUITE_CPU_LOG``
names a file, the process appends one JSON line at exit with its program, its own CPU seconds (user
and system, children not included) and the test that started it (pytest's ``PYTEST_CURRENT_TEST``,
which every child inherits). ``scripts/suite_cpu.py`` sums the lines."""

import os

if os.environ.get("SUITE_CPU_LOG"):
    import atexit
    import json
    import sys

    def _log() -> None:
        times = os.times()
        line = {
            "argv": sys.argv[:3],
            "cpu_s": round(times.user + times.system, 3),
            "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
        }
        with open(os.environ["SUITE_CPU_LOG"], "a") as log:  # one short append per process
            log.write(json.dumps(line) + "\n")

    atexit.register(_log)
