"""Files a script adds to the run's export (``Replica.add_to_export``): what the model needs
beside its weights to load with no code of the script's, such as a Hugging Face model's
``config.json``, which ``from_pretrained`` reads first (``DilocoCallback`` adds it).

``diloco export`` names the weights from the checkpoint without building the model
(``parameter_names.py``), so it cannot know a model's configuration; the script can. Each file
is a checksummed record under ``{run}/export/{name}`` (``RunLayout.export_file``), written
create-only: every replica may add the same text, the first text under a name stays.
"""

from __future__ import annotations

import logging
from typing import Annotated

from pydantic import Field

from diloco_anywhere.bucket.format.framing import Name, WireFormatError
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.format.record import (
    MAX_RECORD_BYTES,
    RECORD_READ_LIMIT,
    Record,
    decode_record,
    encode_record,
)
from diloco_anywhere.bucket.store import Store

log = logging.getLogger(__name__)

RESERVED = ("model.safetensors", "README.md", "run.toml")  # the export's own files


class ExportFile(Record):
    name: Name
    text: Annotated[str, Field(max_length=MAX_RECORD_BYTES - 1024)]


def add_export_file(store: Store, layout: RunLayout, name: str, text: str) -> None:
    """Record ``text`` as the export's file ``name`` (one key segment: letters, digits,
    ``_.=-``); ``ValueError`` for a name the export writes itself or one not allowed."""
    if name in RESERVED:
        raise ValueError(f"export file {name!r}: the export writes it itself; not one of "
                         f"{', '.join(RESERVED)}")  # fmt: skip
    key = layout.export_file(name)
    try:
        store.put(key, encode_record(ExportFile(name=name, text=text)))
    except FileExistsError:
        log.warning("export file %s: the run already holds another text under this name; "
                    "the first one stays", name)  # fmt: skip


class ExportFileError(ValueError):
    """An export file in the bucket that is not one; the message names the key."""


def read_export_files(store: Store, layout: RunLayout) -> dict[str, bytes]:
    """Every file scripts added to the run's export, by name, each checked (its record's
    checksum, and its name the key's)."""
    keys = store.list_prefix(layout.export_files())
    files = {}
    for key, data in store.get_many(keys, limit=RECORD_READ_LIMIT).items():
        try:
            file = decode_record(data or b"", ExportFile, key=key)
        except WireFormatError as exc:
            raise ExportFileError(str(exc)) from None
        if key != layout.export_file(file.name):
            raise ExportFileError(f"{key}: holds export file {file.name!r}, not its key's")
        files[file.name] = file.text.encode()
    return files
