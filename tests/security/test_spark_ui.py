"""Spark's web UI listens on loopback only, and cannot kill a job's stages."""

from __future__ import annotations

import subprocess

import pytest
from pyspark.sql import SparkSession

from tests.integration.test_processor import spark  # noqa: F401  (the shared session fixture)

pytestmark = pytest.mark.integration


def test_the_spark_ui_is_on_loopback_and_read_only(spark: SparkSession) -> None:  # noqa: F811
    url = spark.sparkContext.uiWebUrl or ""
    port = url.rsplit(":", 1)[-1]
    assert port.isdigit(), url
    listening = subprocess.run(
        ["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True
    )
    addresses = [line.split()[3] for line in listening.stdout.splitlines()]
    assert addresses, f"nothing listens on the UI port {port}"
    assert all(a.rsplit(":", 1)[0] in ("127.0.0.1", "[::ffff:127.0.0.1]") for a in addresses), addresses
    assert spark.conf.get("spark.ui.killEnabled") == "false"
