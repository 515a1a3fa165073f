"""Run a command and report the largest peak RSS of any process it started (the launcher's ranks
included): ``python -m tests.helpers.peak_rss OUT -- cmd ...`` writes the bytes to OUT and exits
with the command's code. Every descendant must be waited for by its parent, as launchers do."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path


def main() -> int:
    out, sep, *cmd = sys.argv[1:]
    assert sep == "--", "usage: peak_rss OUT -- cmd ..."
    code = subprocess.call(cmd)
    # ru_maxrss of the children is the largest single descendant's peak, in KiB on Linux.
    Path(out).write_text(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
