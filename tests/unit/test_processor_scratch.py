"""The processor's scratch directory: held while its processor lives, removed once it is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from infra.paths import ROOT
from services.processor.app import DRIVER_JAVA_OPTIONS, session_conf
from services.processor.scratch import LOCK_NAME, claim
from services.processor.settings import ProcessorSettings

# Claims a scratch directory under argv[1], writes a file in it, says where, then waits for stdin to
# close (a live processor) or kills itself with SIGKILL (argv[2] == "kill": no clean-up runs).
CLAIMANT = """
import os, signal, sys
from pathlib import Path
from services.processor.scratch import claim
scratch = claim(Path(sys.argv[1]))
(scratch.path / "spark-files").write_bytes(b"x" * 4096)
print(scratch.path, flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.read()
"""


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


def test_the_first_claim_after_a_kill_removes_what_it_left(tmp_path: Path) -> None:
    root = tmp_path / "scratch"
    dead, dead_dir = claimant(root, "kill")
    dead.wait(30)
    stray = root / "not-a-claim"  # a directory nobody locks (written there by hand): not held, removed
    stray.mkdir()
    scratch = claim(root)
    assert sorted(scratch.reaped) == [(dead_dir.name, 4096), ("not-a-claim", 0)]
    assert not dead_dir.exists() and not stray.exists()
    scratch.release()
    assert not scratch.path.exists()


def test_the_driver_jvm_keeps_its_temporary_files_in_the_scratch_directory(tmp_path: Path) -> None:
    spaced = tmp_path / "a b"
    conf = session_conf(ProcessorSettings(spark_conf={DRIVER_JAVA_OPTIONS: "-Xss4m"}), spaced)
    # java.io.tmpdir is also Spark's local directory when spark.local.dir is not set. Quoted for
    # Spark's splitting of the options.
    assert conf[DRIVER_JAVA_OPTIONS] == f"-Xss4m '-Djava.io.tmpdir={spaced}'"
    assert DRIVER_JAVA_OPTIONS not in session_conf(ProcessorSettings())  # no scratch: nothing added


def test_the_scratch_root_defaults_to_a_per_user_directory_in_the_system_temp_dir(tmp_path: Path) -> None:
    assert ProcessorSettings().scratch_path.name == f"streamforge-processor-{os.getuid()}"
    assert ProcessorSettings(scratch_dir=str(tmp_path)).scratch_path == tmp_path
