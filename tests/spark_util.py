"""Spark in a process of its own, for tests that need a driver JVM nobody else has touched.

The shared session (tests/integration/conftest.py) is one JVM for the whole run: it cannot show what a
fresh JVM loads or initialises, and its JVM options are fixed when it starts. A script run here builds
its own session (``services.processor.app.build_spark``, with whatever ``spark.driver.extraJavaOptions``
it wants: a class-loading log, say), prints what it found, and exits.
"""

from __future__ import annotations

import subprocess
import sys

from infra.paths import ROOT


def run_own_driver(script: str, *args: str, timeout: float = 180) -> list[str]:
    """Run ``script`` (Python source) with ``args`` in a new interpreter from the project root; its
    stdout's lines. A non-zero exit fails the test with the end of its stderr."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()
