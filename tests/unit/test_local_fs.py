"""The processor's local file system for Hadoop: compiled by infra at set-up, put on the driver's class
path by the processor (infra/artifacts/local_fs.py, services/processor/spark/session.py local_fs_options)."""

from __future__ import annotations

import logging
import zipfile
from pathlib import Path

import pytest

from infra.artifacts import local_fs
from services.processor.settings import ProcessorSettings
from services.processor.spark.session import DRIVER_CLASS_PATH, FORKLESS_LOCAL_FS, local_fs_options


def test_set_up_compiles_the_class_once_per_source(tmp_path: Path) -> None:
    jar, made = local_fs.ensure_local_fs_jar(tmp_path, log=lambda _: None)
    assert made and jar.parent == tmp_path / "local-fs"
    with zipfile.ZipFile(jar) as z:
        names = set(z.namelist())
    class_file = FORKLESS_LOCAL_FS.replace(".", "/") + ".class"
    assert {class_file, class_file.replace(".class", "$Raw.class")} <= names
    assert local_fs.ensure_local_fs_jar(tmp_path, log=lambda _: None) == (jar, False)
    assert local_fs.existing_local_fs_jar(tmp_path) == str(jar)
    assert local_fs.existing_local_fs_jar(tmp_path / "elsewhere") == ""


def test_the_jar_name_follows_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = local_fs.jar_path(tmp_path)
    changed = tmp_path / "Changed.java"
    changed.write_text(local_fs.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(local_fs, "SOURCE", changed)
    assert local_fs.jar_path(tmp_path) != before


def test_a_local_driver_gets_the_jar_on_its_class_path_before_any_other(tmp_path: Path) -> None:
    jar = tmp_path / "fs.jar"
    jar.write_bytes(b"PK")
    conf = local_fs_options(ProcessorSettings(local_fs_jar=str(jar), spark_master="local[2]"))
    assert conf == {DRIVER_CLASS_PATH: str(jar), "spark.hadoop.fs.file.impl": FORKLESS_LOCAL_FS}
    given = ProcessorSettings(local_fs_jar=str(jar), spark_conf={DRIVER_CLASS_PATH: "/opt/x.jar"})
    assert local_fs_options(given)[DRIVER_CLASS_PATH] == f"{jar}:/opt/x.jar"


def test_without_the_jar_or_with_remote_executors_hadoop_keeps_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    jar = tmp_path / "fs.jar"
    jar.write_bytes(b"PK")
    assert local_fs_options(ProcessorSettings()) == {}
    # Executors of a cluster do not have the class: they would fail to open a local path. The jar stays
    # on the driver's class path, where the class archive was made with it.
    assert local_fs_options(
        ProcessorSettings(local_fs_jar=str(jar), spark_master="spark://127.0.0.1:7077")
    ) == {DRIVER_CLASS_PATH: str(jar)}
    with caplog.at_level(logging.WARNING):
        assert local_fs_options(ProcessorSettings(local_fs_jar=str(tmp_path / "gone.jar"))) == {}
    assert "gone.jar not found" in caplog.text
