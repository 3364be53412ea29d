"""``diloco data prepare``: a corpus tokenized once into checked token shards in a store, its
documents read as their names say, held out by a hash of their text, resumable, and never
changed once finished."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import crc32c
import numpy as np
import pytest
import zstandard

from diloco_anywhere.bucket.format.framing import PREFIX, WireFormatError
from diloco_anywhere.bucket.format.record import decode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.data.documents import DataSourceError, kind_of, pieces, sources
from diloco_anywhere.data.heldout import held_out
from diloco_anywhere.data.manifest import Manifest
from diloco_anywhere.data.prepare import PrepareError, prepare, settings_for
from diloco_anywhere.data.shards import decode_shard, encode_shard
from diloco_anywhere.data.tokenizers import ByteTokenizer, HfTokenizer
from support.runs import diloco

WORDS = "the cat sat on a mat while dogs ran far away from home and back again".split()  # noqa: SIM905


def _documents(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(count)]


def _jsonl(path: Path, documents: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d}) + "\n" for d in documents))
    return path


def _bytes_settings(**changes):
    options = {"text_field": "text", "heldout_fraction": 0.2, "shard_tokens": 500,
               "block_tokens": 64} | changes  # fmt: skip
    return settings_for(ByteTokenizer(), **options)


def _all_tokens(store: Store, manifest: Manifest, split: str) -> bytes:
    return b"".join(
        decode_shard(store.get(shard.key), shard.key)[1].tobytes()
        for shard in manifest.shards(split)
    )


def test_a_shard_round_trips_and_every_change_to_it_is_refused_naming_it():
    tokens = np.arange(1000, dtype=np.uint16)
    data, header = encode_shard(tokens, "train", 3, 1, block_tokens=256)
    assert len(header.blocks) == 4
    decoded_header, decoded = decode_shard(data, "k")
    assert decoded_header == header
    assert np.array_equal(decoded, tokens)
    for index in (0, 5, 20, len(data) - 1):  # magic, version, header, last token
        corrupt = bytearray(data)
        corrupt[index] ^= 0x01
        with pytest.raises(WireFormatError, match=r"^c: "):
            decode_shard(bytes(corrupt), "c")
    with pytest.raises(WireFormatError, match=r"^t: "):
        decode_shard(data[:-2], "t")


@pytest.mark.parametrize(
    ("name", "expected"),
    [("a.txt", (".txt", None)), ("a.jsonl.gz", (".jsonl", "gzip")),
     ("dir.v2/b.jsonl.zst", (".jsonl", "zstd")), ("c.parquet", (".parquet", None)),
     ("d.txt.bz2", (".txt", "bz2"))],
)  # fmt: skip
def test_a_files_kind_and_compression_come_from_its_name(name, expected):
    assert kind_of(name) == expected


@pytest.mark.parametrize("name", ["notes.md", "data.json", "x.parquet.gz", "archive.gz", "README"])
def test_any_other_name_is_refused_naming_the_file_and_what_is_read(name):
    with pytest.raises(DataSourceError, match=rf"{name}: not a corpus file this reads; name "
                                              r"files \.txt, \.jsonl or \.parquet"):  # fmt: skip
        kind_of(name)


def test_every_kind_and_compression_reads_the_same_documents(tmp_path):
    documents = _documents(30)
    lines = "".join(json.dumps({"body": d}) + "\n" for d in documents).encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": documents}), tmp_path / "c.parquet")
    (tmp_path / "d.txt").write_text("\n".join(documents))
    found = sources(str(tmp_path))
    assert [Path(s.path).name for s in found] == ["a.jsonl.gz", "b.jsonl.zst", "c.parquet", "d.txt"]
    for source in found[:3]:
        assert [p.text for p in pieces(source, "body")] == documents, source.path
    text = list(pieces(found[3], "body"))
    assert "".join(p.text for p in text) == "\n".join(documents)
    assert [p.ends for p in text][-1]


def test_a_large_text_file_comes_in_pieces_that_end_at_lines(tmp_path, monkeypatch):
    monkeypatch.setattr("diloco_anywhere.data.documents.TEXT_PIECE", 100)
    path = tmp_path / "big.txt"
    path.write_text("".join(f"line {i} " * 3 + "\n" for i in range(200)))
    (source,) = sources(str(path))
    parts = list(pieces(source))
    assert "".join(p.text for p in parts) == path.read_text()
    assert len(parts) > 10
    assert all(p.text.endswith("\n") for p in parts[:-1] if p.text)
    assert [p.ends for p in parts] == [False] * (len(parts) - 1) + [True]


def test_bad_lines_and_bad_text_are_refused_naming_the_file_and_line(tmp_path):
    _jsonl(tmp_path / "a.jsonl", ["fine"])
    with (tmp_path / "a.jsonl").open("a") as file:
        file.write('{"title": "no text"}\n')
    (source,) = sources(str(tmp_path / "a.jsonl"))
    with pytest.raises(DataSourceError, match=r"a\.jsonl, line 2: no string 'text' field"):
        list(pieces(source))
    (tmp_path / "b.txt").write_bytes(b"caf\xe9")
    (source,) = sources(str(tmp_path / "b.txt"))
    with pytest.raises(DataSourceError, match=r"b\.txt: not UTF-8 text"):
        list(pieces(source))
    with pytest.raises(DataSourceError, match="no file there"):
        sources(str(tmp_path / "missing*.jsonl"))


def test_the_held_out_split_is_a_hash_of_each_document_alone():
    documents = _documents(4000)
    chosen = {d for d in documents if held_out(d, 0.1)}
    assert 300 < len(chosen) < 500  # about a tenth
    more = documents + _documents(4000, seed=1)  # adding documents moves none of these
    assert {d for d in more[:4000] if held_out(d, 0.1)} == chosen
    assert not any(held_out(d, 0.0) for d in documents)


def test_prepare_with_bytes_keeps_every_document_once_in_order_and_in_checked_shards(tmp_path):
    documents = _documents(120)
    corpus = _jsonl(tmp_path / "a.jsonl", documents)
    store = Store(str(tmp_path / "store"))
    settings = _bytes_settings()
    manifest = prepare(str(corpus), store, ByteTokenizer(), settings)

    held = [d for d in documents if held_out(d, 0.2)]
    trained = [d for d in documents if not held_out(d, 0.2)]
    assert held  # the corpus has both
    assert _all_tokens(store, manifest, "train") == "".join(d + "\n" for d in trained).encode()
    assert _all_tokens(store, manifest, "heldout") == "".join(d + "\n" for d in held).encode()
    (source,) = manifest.sources
    assert (source.documents, source.heldout_documents) == (120, len(held))
    assert all(shard.tokens == 500 for shard in source.train[:-1])
    for shard in manifest.shards("train") + manifest.shards("heldout"):
        data = store.get(shard.key)
        header, tokens = decode_shard(data, shard.key)
        assert (shard.size, shard.tokens) == (len(data), len(tokens))
        assert data[shard.payload_offset :] == tokens.tobytes()
        assert crc32c.crc32c(data[PREFIX.size : shard.payload_offset]) == shard.header_crc32c
        assert len(header.blocks) == -(-shard.tokens // 64)
    stored = decode_record(store.get("manifest"), Manifest, key="manifest")
    assert stored == manifest


def test_prepare_with_a_hugging_face_tokenizer_ends_every_document_with_its_eos(
    tmp_path, hf_corpus
):
    from transformers import AutoTokenizer

    tokenizer_folder, data = hf_corpus
    store = Store(str(tmp_path / "store"))
    tokenizer = HfTokenizer(str(tokenizer_folder))
    settings = settings_for(tokenizer, "text", 0.0, 1 << 16, 1024)
    manifest = prepare(str(data), store, tokenizer, settings)
    reference = AutoTokenizer.from_pretrained(tokenizer_folder)
    documents = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    expected = [t for d in documents
                for t in (*reference(d, add_special_tokens=False)["input_ids"],
                          reference.eos_token_id)]  # fmt: skip
    tokens = np.frombuffer(_all_tokens(store, manifest, "train"), dtype=np.uint8)
    assert manifest.settings.dtype == "uint8"  # 120 tokens
    assert tokens.tolist() == expected
    assert manifest.settings.tokenizer.end_of_document == reference.eos_token_id


def test_an_interrupted_prepare_goes_on_without_reading_a_done_file_or_writing_a_shard_again(
    tmp_path, monkeypatch
):
    monkeypatch.setattr("diloco_anywhere.data.prepare.BATCH_BYTES", 256)  # shards go out early
    (tmp_path / "corpus").mkdir()
    first = _jsonl(tmp_path / "corpus" / "a.jsonl", _documents(80))
    second = _jsonl(tmp_path / "corpus" / "b.jsonl", _documents(80, seed=2))
    good = second.read_text()
    second.write_text(good + "not json\n")  # the prepare stops at the end of b.jsonl
    store = Store(str(tmp_path / "store"))
    settings = _bytes_settings(heldout_fraction=0.0)
    with pytest.raises(DataSourceError, match=r"b\.jsonl, line 81: not a JSON object"):
        prepare(str(tmp_path / "corpus"), store, ByteTokenizer(), settings)
    written = set(store.list_prefix("train"))
    assert any(key.startswith("train/00001-") for key in written)  # b's first shards are in

    first.write_bytes(b"\xff" * first.stat().st_size)  # a.jsonl is done: reading it would fail
    second.write_text(good)
    before = store.stats()
    manifest = prepare(str(tmp_path / "corpus"), store, ByteTokenizer(), settings)
    puts = (store.stats() - before).puts
    new_shards = len(manifest.shards("train")) - len(written)
    # the settings (an idempotent put of the same bytes), b's entry, the manifest; no shard twice
    assert puts == new_shards + 3
    assert manifest.sources[0].documents == 80


def test_a_shards_block_checksums_must_fit_its_header():
    with pytest.raises(ValueError, match="shard_tokens / block_tokens is at most 4096"):
        _bytes_settings(shard_tokens=4097 * 64, block_tokens=64)


def test_a_folder_refuses_other_settings_and_a_finished_one_another_corpus(tmp_path):
    corpus = _jsonl(tmp_path / "a.jsonl", _documents(20))
    store = Store(str(tmp_path / "store"))
    prepare(str(corpus), store, ByteTokenizer(), _bytes_settings())
    with pytest.raises(PrepareError, match=r"another shard_tokens 500: prepare into an empty"):
        prepare(str(corpus), store, ByteTokenizer(), _bytes_settings(shard_tokens=600))
    _jsonl(tmp_path / "a.jsonl", _documents(21))
    with pytest.raises(PrepareError, match=r"the corpus changed|never changes under a run"):
        prepare(str(corpus), store, ByteTokenizer(), _bytes_settings())


def test_diloco_data_prepare_prints_the_splits_and_says_a_second_run_has_nothing_to_do(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    _jsonl(tmp_path / "a.jsonl", _documents(200))
    arguments = ("data", "prepare", "a.jsonl", "store", "--tokenizer", "bytes")
    result = diloco(*arguments, "--heldout-fraction", "0.1", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["files"] == 1
    assert summary["train"]["documents"] + summary["heldout"]["documents"] == 200
    assert summary["heldout"]["documents"] > 0
    assert summary["dtype"] == "uint8"
    again = diloco(*arguments, "--heldout-fraction", "0.1")
    assert again.exit_code == 0, again.output
    assert "prepared already: nothing to do" in " ".join(again.stdout.split())
    (tmp_path / "notes.md").write_text("x")
    wrong = diloco("data", "prepare", "notes.md", "store2", "--tokenizer", "bytes")
    assert wrong.exit_code == 1
    assert "notes.md: not a corpus file this reads" in " ".join(wrong.output.split())
