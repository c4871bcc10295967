"""transformWithState's operator metadata names its state schema files by absolute path.

Spark writes ``state/<op>/_metadata/v2/<batch>`` with the full URI of each ``_stateSchema`` file, so
a checkpoint that moved (restored from a savepoint, renamed to a new epoch on a takeover) would read
the old place's files, which may be gone. Before a query starts on a checkpoint, its paths are made
to point into the checkpoint itself, where the same files were copied or moved with it.
"""

from __future__ import annotations

import re

from services.processor.state.storage import StateStorage

# A schema file's path up to and including the operator's directory, as Spark writes it in JSON.
_SCHEMA_PATH = re.compile(r'"[^"]*/state/(\d+)/_stateSchema/')


def relocate_schema_paths(storage: StateStorage, checkpoint: str) -> int:
    """Point every operator metadata file of ``checkpoint`` at its own schema files; how many changed."""
    state = f"{checkpoint.rstrip('/')}/state"
    changed = 0
    for operator in storage.list_names(state):
        metadata = f"{state}/{operator}/_metadata/v2"
        for name in storage.list_names(metadata):
            if name.startswith("."):  # Hadoop's checksum files (.<name>.crc)
                continue
            uri = f"{metadata}/{name}"
            data = storage.read_bytes(uri)
            if data is None:
                continue
            text = data.decode()
            moved = _SCHEMA_PATH.sub(lambda m: f'"{state}/{m.group(1)}/_stateSchema/', text)
            if moved != text:
                storage.write_atomic(uri, moved.encode())
                # The local file system's checksum of the old text would fail Spark's read; without
                # one, Hadoop reads the file unchecked.
                storage.delete(f"{metadata}/.{name}.crc")
                changed += 1
    return changed
