"""Operators installed for a test: a distribution's metadata written beside the tests' code.

The shared virtualenv holds the project as an editable install whose entry points date from its last
install; a test writes the entry points it needs (the shipped ones, read from pyproject.toml, and its
own) as a real ``*.dist-info`` directory on the path, so discovery runs as it does in production, in
this process and in Spark's Python workers.
"""

from __future__ import annotations

import sys
import tomllib
import uuid
from pathlib import Path

from pyspark.sql import SparkSession

from infra.paths import ROOT
from shared.operators import GROUP, installed_operators


def shipped_operators() -> dict[str, str]:
    """The operators pyproject.toml registers: name -> "module:Class"."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return dict(project["entry-points"][GROUP])


def install_operators(where: Path, operators: dict[str, str], spark: SparkSession | None = None) -> Path:
    """Register ``operators`` in a distribution under ``where``, put it on this process's path and
    (with ``spark``) on its Python workers'; returns the directory to add to a PYTHONPATH."""
    # A name of its own: importlib.metadata sees one distribution per name, so a second install under
    # the same name (another test module's, earlier on the path) would hide this one's entry points.
    name = f"streamforge_test_operators_{uuid.uuid4().hex[:8]}"
    info = where / f"{name}-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in operators.items())
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{lines}")
    if str(where) not in sys.path:
        sys.path.append(str(where))
    installed_operators.cache_clear()
    if spark is not None:
        # The workers import this checkout's code (not the editable install's) and find the entry points.
        spark.sparkContext.environment["PYTHONPATH"] = f"{ROOT}:{where}"
    return where
