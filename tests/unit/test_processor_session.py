"""The Spark settings the processor derives from its own (services/processor/spark/session.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from services.processor.settings import MIN_DRIVER_MEMORY_MIB, ProcessorSettings, memory_mib
from services.processor.spark.session import (
    DRIVER_JAVA_OPTIONS,
    EXECUTOR_JAVA_OPTIONS,
    JIT_OPTIONS,
    OBJECT_HASH_AGG_GROUPS,
    REALTIME_SHUFFLE_FLUSH,
    STATE_CLEANUP_PER_ROW,
    session_conf,
)


def test_the_real_time_shuffle_flushes_within_5_ms_unless_the_profile_is_throughput(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert session_conf(ProcessorSettings())[REALTIME_SHUFFLE_FLUSH] == "5"
    monkeypatch.setenv("SF_PROFILE", "throughput")
    assert session_conf(ProcessorSettings())[REALTIME_SHUFFLE_FLUSH] == "50"  # Spark's own default
    monkeypatch.setenv("SF_PROCESSOR_TUNING", '{"realtime_shuffle_flush_ms": 20}')  # wins over the profile
    assert session_conf(ProcessorSettings())[REALTIME_SHUFFLE_FLUSH] == "20"


def test_closed_windows_leave_the_state_as_rows_arrive_unless_set_to_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert session_conf(ProcessorSettings())[STATE_CLEANUP_PER_ROW] == "4"
    monkeypatch.setenv("SF_PROCESSOR_TUNING", '{"state_cleanup_per_row": 0}')  # Spark's own: at the end
    assert session_conf(ProcessorSettings())[STATE_CLEANUP_PER_ROW] == "0"
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        ProcessorSettings(tuning_overrides={"state_cleanup_per_row": -1})


def test_percentile_jobs_aggregate_by_hash_up_to_the_groups_set(monkeypatch: pytest.MonkeyPatch) -> None:
    assert session_conf(ProcessorSettings())[OBJECT_HASH_AGG_GROUPS] == "65536"  # Spark's: 128
    monkeypatch.setenv("SF_PROCESSOR_TUNING", '{"object_hash_agg_groups": 128}')
    assert session_conf(ProcessorSettings())[OBJECT_HASH_AGG_GROUPS] == "128"
    given = ProcessorSettings(spark_conf={OBJECT_HASH_AGG_GROUPS: "10"})
    assert session_conf(given)[OBJECT_HASH_AGG_GROUPS] == "10"  # spark_conf wins, as for every setting


def test_spark_conf_given_explicitly_wins_over_the_derived_settings() -> None:
    settings = ProcessorSettings(spark_conf={REALTIME_SHUFFLE_FLUSH: "1"})
    assert session_conf(settings)[REALTIME_SHUFFLE_FLUSH] == "1"
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        ProcessorSettings(tuning_overrides={"realtime_shuffle_flush_ms": 0})
    with pytest.raises(ValueError, match="less than or equal to 1000"):
        ProcessorSettings(tuning_overrides={"realtime_shuffle_flush_ms": 1_001})


def test_an_unknown_tuning_override_is_refused_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SF_PROCESSOR_TUNING", '{"realtime_shuffle_flush": 20}')
    with pytest.raises(ValueError, match=r"unknown tuning \['realtime_shuffle_flush'\]"):
        ProcessorSettings()


@pytest.mark.parametrize(
    ("given", "mib"), [("768m", 768), ("1G", 1024), (" 1g ", 1024), ("524288k", 512), ("2T", 2 * 1024**2)]
)
def test_the_driver_heap_is_read_as_the_jvm_reads_it(given: str, mib: int) -> None:
    assert memory_mib(given) == mib
    assert ProcessorSettings(driver_memory=given).driver_memory == given.strip()  # -Xmx as written


@pytest.mark.parametrize("given", ["768", "1gb", "1.5g", "-1g", "lots", ""])
def test_a_driver_heap_without_a_jvm_unit_is_refused_before_spark_starts(given: str) -> None:
    # "768" would be 768 bytes to the JVM's -Xmx and 768 MiB to Spark: refused rather than guessed.
    with pytest.raises(ValueError, match="is not a heap size with a unit, such as 768m or 1g"):
        ProcessorSettings(driver_memory=given)


def test_a_driver_heap_under_spark_s_minimum_is_refused_before_spark_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert ProcessorSettings(driver_memory=f"{MIN_DRIVER_MEMORY_MIB}m").driver_memory == "512m"
    monkeypatch.setenv("SF_PROCESSOR_DRIVER_MEMORY", "450m")  # Spark's own floor; not with serial GC
    with pytest.raises(ValueError, match="'450m' is under the minimum driver heap, 512m: Spark refuses"):
        ProcessorSettings()


def test_the_default_quick_jit_stops_spark_s_jvms_at_c1_after_the_options_already_given(
    tmp_path: Path,
) -> None:
    archive = tmp_path / "spark.jsa"
    archive.write_bytes(b"archive")
    given = {DRIVER_JAVA_OPTIONS: "-Xss4m", EXECUTOR_JAVA_OPTIONS: "-Xss8m"}
    quick = session_conf(ProcessorSettings(class_archive=str(archive), spark_conf=given))
    assert quick[DRIVER_JAVA_OPTIONS] == (
        f"-Xss4m -XX:SharedArchiveFile={archive} -Xshare:auto -XX:TieredStopAtLevel=1"
    )
    assert quick[EXECUTOR_JAVA_OPTIONS] == "-Xss8m -XX:TieredStopAtLevel=1"
    # Nothing given: the JIT's option alone.
    assert session_conf(ProcessorSettings())[EXECUTOR_JAVA_OPTIONS] == "-XX:TieredStopAtLevel=1"

    tiered_settings = ProcessorSettings(
        class_archive=str(archive), spark_conf=given, tuning_overrides={"jit": "tiered"}
    )
    tiered = session_conf(tiered_settings)
    assert tiered[DRIVER_JAVA_OPTIONS] == f"-Xss4m -XX:SharedArchiveFile={archive} -Xshare:auto"
    assert tiered[EXECUTOR_JAVA_OPTIONS] == "-Xss8m"
    # The tiered JIT adds no key at all; the throughput profile compiles with it.
    assert DRIVER_JAVA_OPTIONS not in session_conf(ProcessorSettings(tuning_overrides={"jit": "tiered"}))
    assert EXECUTOR_JAVA_OPTIONS not in session_conf(ProcessorSettings(profile="throughput"))
    with pytest.raises(ValueError, match="'tiered' or 'quick'"):
        ProcessorSettings(tuning_overrides={"jit": "c2"})


def test_the_quick_jit_option_is_one_this_jdk_applies() -> None:
    """Spark's launcher passes -XX:+IgnoreUnrecognizedVMOptions, so an option the JDK does not know
    would be dropped without a word: ask the JDK Spark runs on what it makes of it."""
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    assert java, "no java: Spark needs one"
    flags = subprocess.run(
        [java, *JIT_OPTIONS["quick"].split(), "-XX:+PrintFlagsFinal", "-version"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert re.search(r"\bTieredStopAtLevel\s+=\s+1\s+\{product\}.*\{command line\}", flags), flags[-2000:]
