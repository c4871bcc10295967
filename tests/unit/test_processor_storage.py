"""The processor's storage interface on local files (services/processor/state/storage.py); the same
operations on HDFS: tests/integration/test_processor_hdfs.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from services.processor.state.schema_paths import relocate_schema_paths
from services.processor.state.storage import LocalStorage, join, local_path, shown, storage_for, to_uri
from shared.allowed_paths import under_roots


def test_uris_paths_and_names(tmp_path: Path) -> None:
    assert to_uri(str(tmp_path)) == tmp_path.resolve().as_uri()
    assert to_uri("hdfs://nn:9820/sf/") == "hdfs://nn:9820/sf"
    assert join("hdfs://nn:9820/sf", "checkpoints", "j") == "hdfs://nn:9820/sf/checkpoints/j"
    assert local_path(to_uri(tmp_path / "a b")) == tmp_path / "a b"
    assert shown(to_uri(tmp_path)) == str(tmp_path) and shown("hdfs://nn:9820/x") == "hdfs://nn:9820/x"
    assert isinstance(storage_for(to_uri(tmp_path)), LocalStorage)
    with pytest.raises(OSError, match="Hadoop client"):
        storage_for("hdfs://nn:9820/x")  # no Spark session given


def test_local_storage_reads_writes_lists_and_copies(tmp_path: Path) -> None:
    s, root = LocalStorage(), to_uri(tmp_path)
    note = join(root, "a", "b", "note")
    assert s.read_bytes(note) is None and not s.exists(note) and s.list_names(join(root, "a")) == []
    s.write_atomic(note, b"one")
    s.write_atomic(note, b"two")
    assert s.read_bytes(note) == b"two" and s.list_names(join(root, "a", "b")) == ["note"]  # no temporaries
    s.copy_tree(join(root, "a"), join(root, "copy"))
    assert (tmp_path / "copy/b/note").read_bytes() == b"two"
    with pytest.raises(FileExistsError):
        s.copy_tree(join(root, "a"), join(root, "copy"))
    s.delete(join(root, "copy"))
    s.delete(join(root, "nothing"))
    assert s.list_names(root) == ["a"]


def test_create_new_has_one_winner(tmp_path: Path) -> None:
    s, target = LocalStorage(), to_uri(tmp_path / "x" / "note")
    barrier, won = threading.Barrier(6), []

    def create(i: int) -> None:
        barrier.wait()
        won.append(s.create_new(target, f"{i}".encode()))

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert won.count(True) == 1 and s.read_bytes(target) in {f"{i}".encode() for i in range(6)}


def test_rename_new_refuses_an_existing_destination_and_a_missing_source(tmp_path: Path) -> None:
    s, root = LocalStorage(), to_uri(tmp_path)
    for name in ("src", "empty", "full"):
        s.mkdirs(join(root, name))
    s.write_atomic(join(root, "src", "f"), b"1")
    s.write_atomic(join(root, "full", "g"), b"2")
    assert not s.rename_new(join(root, "src"), join(root, "empty"))  # plain rename(2) would replace it
    assert not s.rename_new(join(root, "src"), join(root, "full"))
    assert s.rename_new(join(root, "src"), join(root, "moved"))
    assert not s.rename_new(join(root, "src"), join(root, "again"))  # the source is gone
    assert s.read_bytes(join(root, "moved", "f")) == b"1" and s.list_names(join(root, "empty")) == []


def test_savepoint_paths_under_roots_as_paths_or_uris(tmp_path: Path) -> None:
    local = [to_uri(tmp_path / "sp")]
    assert under_roots(str(tmp_path / "sp" / "x"), local) and under_roots(
        to_uri(tmp_path / "sp" / "x"), local
    )
    assert not under_roots(str(tmp_path / "sp" / ".." / "other"), local)
    remote = ["hdfs://nn:9820/sf/savepoints"]
    assert under_roots("hdfs://nn:9820/sf/savepoints/j-1", remote)
    assert not under_roots("hdfs://nn:9820/sf/savepoints/../checkpoints", remote)
    assert not under_roots("hdfs://other:9820/sf/savepoints/j-1", remote)
    assert not under_roots("hdfs://nn:9820/sf/savepoints-2/j", remote)
    assert not under_roots("/sf/savepoints/j-1", remote)


def test_operator_metadata_is_pointed_at_its_own_checkpoint(tmp_path: Path) -> None:
    """A checkpoint restored elsewhere: transformWithState's metadata names its schema files there."""
    s, root = LocalStorage(), to_uri(tmp_path / "epoch-1")
    old = "file:/elsewhere/epoch-0/state/0/_stateSchema/default/0_ab"
    info = {"stateStoreInfo": [{"storeName": "default", "stateSchemaFilePaths": [old]}]}
    text = "v2\n" + json.dumps(info)
    (tmp_path / "epoch-1/state/0/_metadata/v2").mkdir(parents=True)
    (tmp_path / "epoch-1/state/0/_metadata/v2/0").write_text(text)
    (tmp_path / "epoch-1/state/0/_metadata/v2/.0.crc").write_bytes(b"\xcc\x01")  # the old text's
    (tmp_path / "epoch-1/state/1/_metadata/v2").mkdir(parents=True)  # an operator with none yet
    assert relocate_schema_paths(s, root) == 1
    moved = (tmp_path / "epoch-1/state/0/_metadata/v2/0").read_text()
    assert moved == text.replace("file:/elsewhere/epoch-0", root)
    assert not (tmp_path / "epoch-1/state/0/_metadata/v2/.0.crc").exists()
    assert relocate_schema_paths(s, root) == 0  # already in place: left alone
