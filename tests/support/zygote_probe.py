"""A rank stand-in for tests/unit/test_zygote.py: ``python -m tests.support.zygote_probe
OUT CODE`` writes what it was started with to OUT, a line to stderr, and exits with CODE
(``hang``: sleeps until killed; ``echo``: writes stdin's first line back upper-cased,
then sleeps until killed)."""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    out, code = sys.argv[1], sys.argv[2]
    seen = {
        "argv": sys.argv[1:],
        "name": __name__,
        "cwd": os.getcwd(),
        "probe": os.environ.get("CHECKPOINTD_TEST_PROBE"),
        "torch_loaded": "torch" in sys.modules,
    }
    Path(out).write_text(json.dumps(seen))
    print("probe on stderr", file=sys.stderr)
    print("probe on stdout")
    atexit.register(lambda: Path(out + ".atexit").write_text("ran"))
    if code == "hang":
        time.sleep(600)
    if code == "echo":  # stdin back on stdout, then wait for a signal
        print(sys.stdin.readline().strip().upper(), flush=True)
        time.sleep(600)
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
