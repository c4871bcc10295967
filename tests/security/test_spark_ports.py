"""Spark's own ports in the processor's driver JVM (its RPC and its block manager's transfers, random
ports on loopback) ask every caller for the secret (services/processor/app.py, local_auth_options).

Without ``spark.authenticate`` the RPC port hands what any local process sends it to Java
deserialization; the probe here sends an RPC request whose body is 16 zero bytes and reads the error
Spark sends back."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import urllib.request
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from tests.integration.test_processor import spark  # noqa: F401  (the shared session fixture)
from tests.spark_util import run_own_driver

pytestmark = pytest.mark.integration

SASL_REFUSAL = "java.lang.IllegalStateException: Expected SaslMessage, received something else"


def probe(port: int) -> str:
    """Send an RpcRequest (message type 3, request id 7) with a body of zeros; the first line of the
    error the server answers with."""
    body = bytes(16)
    message = struct.pack(">bqi", 3, 7, len(body)) + body
    with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
        conn.sendall(struct.pack(">q", 8 + len(message)) + message)
        reply = b""
        while b"\n" not in reply and (chunk := conn.recv(65536)):
            reply += chunk
    # The reply: frame length (8 bytes), type (1), request id (8), error length (4), then the error.
    return reply[21:].split(b"\n")[0].decode(errors="replace")


def spark_ports(session: SparkSession) -> dict[str, int]:
    """The driver JVM's listening ports other than py4j's (it has a token of its own) and the UI's."""
    sc = session.sparkContext
    assert sc._jvm is not None and sc._gateway is not None
    pid = sc._jvm.ProcessHandle.current().pid()
    listening = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    ports = {
        int(line.split()[3].rsplit(":", 1)[1]) for line in listening.splitlines() if f"pid={pid}," in line
    }
    ui = int((sc.uiWebUrl or ":0").rsplit(":", 1)[1])
    rpc = int(sc.getConf().get("spark.driver.port") or 0)
    # The driver's block manager, as the UI's REST API names it (its hostPort).
    executors = json.loads(
        urllib.request.urlopen(f"{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}/executors").read()
    )
    blocks = int(next(e for e in executors if e["id"] == "driver")["hostPort"].rsplit(":", 1)[1])
    # Other ports may listen once Python workers ran (transformWithState's state servers, whose
    # callers are the driver's own workers); the two Spark serves to executors must be among them.
    assert rpc in ports and blocks in ports, (ports, rpc, blocks, ui)
    return {"rpc": rpc, "blocks": blocks}


def test_the_drivers_rpc_and_block_ports_refuse_a_caller_without_the_secret(
    spark: SparkSession,  # noqa: F811
) -> None:
    assert spark.sparkContext.getConf().get("spark.authenticate") == "true"
    for name, port in spark_ports(spark).items():
        assert probe(port).startswith(SASL_REFUSAL), name


# Spark as it is without the setting (spark_conf turns it off): the same probe reaches Java's
# deserialization, so the test above would see it.
UNAUTHENTICATED = """
import sys
from services.processor.spark.session import build_spark
from services.processor.settings import ProcessorSettings
from tests.security.test_spark_ports import probe
settings = ProcessorSettings(
    spark_ui_port=0, data_dir=sys.argv[1], spark_conf={"spark.authenticate": "false"}
)
spark = build_spark(settings, [])
print("rpc:", probe(int(spark.sparkContext.getConf().get("spark.driver.port"))))
spark.stop()
"""


def test_without_the_secret_the_rpc_port_deserializes_what_any_caller_sends(tmp_path: Path) -> None:
    (line,) = [x for x in run_own_driver(UNAUTHENTICATED, str(tmp_path)) if x.startswith("rpc:")]
    assert line.startswith("rpc: java.io.StreamCorruptedException: invalid stream header: 00000000"), line
