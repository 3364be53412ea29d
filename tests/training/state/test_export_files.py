"""Files a script adds to the run's export (``Replica.add_to_export``): recorded once, the same
text from every replica accepted, each checked when the export reads it back."""

from __future__ import annotations

import logging

import pytest

from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.format.record import encode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.training.state.export_files import (
    ExportFile,
    ExportFileError,
    add_export_file,
    read_export_files,
)

LAYOUT = RunLayout("r")


def test_every_replica_may_add_the_same_file_and_the_first_text_stays(tmp_path, caplog):
    store = Store(str(tmp_path))
    for _ in range(2):  # every replica adds the model's config
        add_export_file(store, LAYOUT, "config.json", '{"vocab_size": 7}')
    add_export_file(store, LAYOUT, "tokenizer.json", "{}")
    with caplog.at_level(logging.WARNING):
        add_export_file(store, LAYOUT, "config.json", '{"vocab_size": 8}')
    assert "already holds another text under this name" in caplog.text
    assert read_export_files(store, LAYOUT) == {
        "config.json": b'{"vocab_size": 7}', "tokenizer.json": b"{}"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("name", "problem"),
    [("model.safetensors", "the export writes it itself"), ("a/b.json", "is not allowed")],
)
def test_a_name_the_export_owns_or_not_one_key_segment_is_refused(tmp_path, name, problem):
    with pytest.raises(ValueError, match=problem):
        add_export_file(Store(str(tmp_path)), LAYOUT, name, "{}")


def test_a_damaged_file_or_one_under_another_key_is_refused_naming_the_key(tmp_path):
    store = Store(str(tmp_path))
    add_export_file(store, LAYOUT, "config.json", '{"vocab_size": 7}')
    path = tmp_path / LAYOUT.export_file("config.json")
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ExportFileError, match=r"r/export/config\.json"):
        read_export_files(store, LAYOUT)
    path.unlink()
    store.put(LAYOUT.export_file("x.json"), encode_record(ExportFile(name="y.json", text="")))
    with pytest.raises(ExportFileError, match=r"r/export/x\.json: holds export file 'y\.json'"):
        read_export_files(store, LAYOUT)
