"""The processor's scratch directory: held while its processor lives, removed once it is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from infra.paths import ROOT
from services.processor.settings import ProcessorSettings
from services.processor.spark.scratch import LOCK_NAME, claim
from services.processor.spark.session import (
    DEFAULT_PARALLELISM,
    DRIVER_JAVA_OPTIONS,
    EXECUTOR_JAVA_OPTIONS,
    master_url,
    session_conf,
)

# Claims a scratch directory under argv[1], writes a file in it, says where, then waits for stdin to
# close (a live processor) or kills itself with SIGKILL (argv[2] == "kill": no clean-up runs).
CLAIMANT = """
import os, signal, sys
from pathlib import Path
from services.processor.spark.scratch import claim
scratch = claim(Path(sys.argv[1]))
(scratch.path / "spark-files").write_bytes(b"x" * 4096)
print(scratch.path, flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.read()
"""

# The tiered JIT adds no JVM option: what else the processor adds shows alone.
NO_JIT_OPTION = {"jit": "tiered"}


def claimant(root: Path, mode: str) -> tuple[subprocess.Popen[str], Path]:
    child = subprocess.Popen(
        [sys.executable, "-c", CLAIMANT, str(root), mode],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    return child, Path(child.stdout.readline().strip())


def test_a_killed_processors_directory_is_removed_by_the_next_claim_and_a_live_ones_kept(
    tmp_path: Path,
) -> None:
    root = tmp_path / "scratch"
    dead, dead_dir = claimant(root, "kill")
    assert dead.wait(30) == -signal.SIGKILL
    assert (dead_dir / "spark-files").is_file()  # the kill left its files behind
    live, live_dir = claimant(root, "wait")
    try:
        assert not dead_dir.exists()  # the next claim, the live claimant's, removed them
        mine = claim(root)
        assert mine.reaped == []  # nothing else was dead by then
        assert live_dir.is_dir() and (live_dir / "spark-files").is_file()  # its holder lives
        assert mine.path.parent == root and mine.path.name.startswith(f"{os.getpid()}-")
        assert (mine.path / LOCK_NAME).is_file()
    finally:
        assert live.stdin is not None
        live.stdin.close()  # the live claimant exits without releasing: like a crash
        assert live.wait(30) == 0
    again = claim(root)
    assert again.reaped == [(live_dir.name, 4096)]
    assert not live_dir.exists() and mine.path.is_dir()  # ours is held by this process: kept
    mine.release()
    again.release()
    assert sorted(p.name for p in root.iterdir()) == [".sf-claims-lock"]


def test_only_a_claims_directory_is_ever_removed(tmp_path: Path) -> None:
    root = tmp_path / "scratch"
    dead, dead_dir = claimant(root, "kill")
    dead.wait(30)
    # Put there by someone else: another name, a claim's name without its lock file, a link to a
    # directory with a lock file in it. None is held, and none is removed.
    others = [root / "not-a-claim", root / "123-0badc0de"]
    for d in others:
        d.mkdir()
    (root / "not-a-claim" / LOCK_NAME).touch()
    target = tmp_path / "mine"
    target.mkdir()
    (target / LOCK_NAME).touch()
    (root / "456-0badc0de").symlink_to(target)
    scratch = claim(root)
    assert scratch.reaped == [(dead_dir.name, 4096)]
    assert not dead_dir.exists()
    assert all(d.is_dir() for d in others) and (target / LOCK_NAME).exists()
    scratch.release()
    assert not scratch.path.exists()


def test_a_root_someone_else_could_have_made_is_not_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The default root is a guessable name in the shared /tmp: one made first by another user (a
    link to a directory of ours, or a directory others can write) is neither used nor reaped."""
    victim = tmp_path / "victim"
    (victim / "123-0badc0de").mkdir(parents=True)  # named like a claim, lock file and all
    (victim / "123-0badc0de" / LOCK_NAME).touch()
    link = tmp_path / "scratch-link"
    link.symlink_to(victim)
    shared = tmp_path / "scratch-shared"
    shared.mkdir()
    shared.chmod(0o777)
    for root, why in ((link, "is not a directory"), (shared, "is writable by others (mode 777)")):
        scratch = claim(root)
        assert scratch.path.parent == Path(tempfile.gettempdir()) and scratch.reaped == []
        assert f"scratch root {root} {why}" in caplog.text
        scratch.release()
        assert not scratch.path.exists()
    assert (victim / "123-0badc0de" / LOCK_NAME).exists()
    assert list(shared.iterdir()) == []
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    scratch = claim(dangling)
    assert "cannot be used" in caplog.text
    scratch.release()


def test_the_driver_jvm_keeps_its_temporary_files_in_the_scratch_directory(tmp_path: Path) -> None:
    spaced = tmp_path / "a b"
    given = {DRIVER_JAVA_OPTIONS: "-Xss4m"}
    conf = session_conf(ProcessorSettings(spark_conf=given, tuning_overrides=NO_JIT_OPTION), spaced)
    # java.io.tmpdir is also Spark's local directory when spark.local.dir is not set. Quoted for
    # Spark's splitting of the options.
    assert conf[DRIVER_JAVA_OPTIONS] == f"-Xss4m '-Djava.io.tmpdir={spaced}'"
    no_scratch = session_conf(ProcessorSettings(tuning_overrides=NO_JIT_OPTION))
    assert DRIVER_JAVA_OPTIONS not in no_scratch  # nothing added
    given = {DRIVER_JAVA_OPTIONS: "-Djava.io.tmpdir=/big/disk"}  # spark_conf's own wins
    assert (
        session_conf(ProcessorSettings(spark_conf=given, tuning_overrides=NO_JIT_OPTION), spaced)[
            DRIVER_JAVA_OPTIONS
        ]
        == given[DRIVER_JAVA_OPTIONS]
    )


def test_a_standalone_clusters_executors_keep_their_temporary_files_in_their_work_directory() -> None:
    cluster = ProcessorSettings(spark_master="spark://127.0.0.1:7077", tuning_overrides=NO_JIT_OPTION)
    assert session_conf(cluster)[EXECUTOR_JAVA_OPTIONS] == "-Djava.io.tmpdir=."
    quick = ProcessorSettings(spark_master="spark://127.0.0.1:7077")
    assert session_conf(quick)[EXECUTOR_JAVA_OPTIONS].endswith(" -Djava.io.tmpdir=.")
    # In local mode the executors are the driver's JVM; spark_conf's own choice wins.
    local = session_conf(ProcessorSettings(tuning_overrides=NO_JIT_OPTION))
    assert EXECUTOR_JAVA_OPTIONS not in local
    given = {EXECUTOR_JAVA_OPTIONS: "-Djava.io.tmpdir=/big/disk"}
    own = ProcessorSettings(
        spark_master="spark://127.0.0.1:7077", spark_conf=given, tuning_overrides=NO_JIT_OPTION
    )
    assert session_conf(own)[EXECUTOR_JAVA_OPTIONS] == given[EXECUTOR_JAVA_OPTIONS]


def test_the_scratch_root_defaults_to_a_per_user_directory_in_the_system_temp_dir(tmp_path: Path) -> None:
    assert ProcessorSettings().scratch_path.name == f"streamforge-processor-{os.getuid()}"
    assert ProcessorSettings(scratch_dir=str(tmp_path)).scratch_path == tmp_path


def test_a_local_master_keeps_real_time_slots_beside_its_cores() -> None:
    """Real-time tasks get threads of their own; micro-batches still plan for the cores."""
    default = ProcessorSettings()
    assert master_url(default) == f"local[{2 + default.realtime_task_slots}]"
    assert session_conf(default)[DEFAULT_PARALLELISM] == "2"
    assert master_url(ProcessorSettings(spark_master="local[4,3]", realtime_task_slots=2)) == "local[6,3]"
    assert master_url(ProcessorSettings(spark_master="local[2]", realtime_task_slots=0)) == "local[2]"
    cluster = ProcessorSettings(spark_master="spark://127.0.0.1:7077")
    assert master_url(cluster) == "spark://127.0.0.1:7077"
    assert DEFAULT_PARALLELISM not in session_conf(cluster)
    own = ProcessorSettings(spark_conf={DEFAULT_PARALLELISM: "6"})
    assert session_conf(own)[DEFAULT_PARALLELISM] == "6"
