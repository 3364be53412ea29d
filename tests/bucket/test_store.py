"""Store behaviour on every backend: local path, file://, memory://, S3 (moto), GCS, Azure."""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.request
from pathlib import Path

import crc32c
import fsspec
import pytest

from diloco_anywhere.bench.tools.processes import worker_context
from diloco_anywhere.bucket import whole_files
from diloco_anywhere.bucket.errors import StoreError
from diloco_anywhere.bucket.keys import check_key
from diloco_anywhere.bucket.redaction import redact_url, scrub_secrets
from diloco_anywhere.bucket.store import Store


def test_put_then_get_whole_and_range(backend):
    store = backend.store()
    payload = bytes(range(256)) * 40
    store.put("rounds/0/a", payload)
    assert store.get("rounds/0/a") == payload
    assert store.get("rounds/0/a", 100, 1100) == payload[100:1100]
    assert store.get("rounds/0/a", 0, 0) == b""


def test_bounded_reads_fetch_at_most_their_limit_and_empty_objects_read_empty(backend):
    """A reader bounds what it fetches of an object anyone could have written; a range
    starting at or past an object's end (S3 and Azure answer 416) holds no bytes."""
    store = backend.store()
    store.put("big", bytes(range(256)) * 4096)  # 1 MiB
    store.put("empty", b"")
    before = store.stats().bytes_down
    assert store.get_many(["big", "empty", "absent"], limit=100) == {
        "big": bytes(range(100)), "empty": b"", "absent": None
    }  # fmt: skip
    view = store.get_into("big", lambda size: memoryview(bytearray(size)), limit=300)
    assert bytes(view) == (bytes(range(256)) * 2)[:300]
    assert bytes(store.get_into("empty", lambda size: memoryview(bytearray(size)), limit=9)) == b""
    assert store.get("empty", 0, 10) == b""
    assert store.get("big", 1 << 20, (1 << 20) + 5) == b""
    assert store.stats().bytes_down - before == 400


def test_put_is_idempotent_for_identical_bytes(backend):
    store = backend.store()
    store.put("reduced/0", b"same deterministic bytes")
    store.put("reduced/0", bytearray(b"same deterministic bytes"))
    assert store.get("reduced/0") == b"same deterministic bytes"


def test_a_file_put_and_got_back_in_chunks_is_the_same_bytes(backend, tmp_path, monkeypatch):
    """A checkpoint's part goes to the store from a local file and comes back into one, in
    chunks (``put_file``, ``get_file``): 48 MiB through parts of 16 MiB (S3's multipart
    upload, GCS's resumable one, Azure's blocks), create-only, idempotent like ``put``."""
    store = backend.store()
    payload = os.urandom(1 << 20) * 48 + b"tail"
    source = tmp_path / "part"
    source.write_bytes(payload)
    spool = store.spool("checkpoints/0/shard-00000.safetensors")
    os.replace(source, spool)
    store.put_file("checkpoints/0/shard-00000.safetensors", spool)
    store.put_file("checkpoints/0/shard-00000.safetensors", spool)  # the same bytes: no-op
    os.unlink(spool)
    key = "checkpoints/0/shard-00000.safetensors"
    assert store.checksum(key, len(payload) + 1) == (len(payload), crc32c.crc32c(payload))
    monkeypatch.setattr(whole_files, "DOWNLOAD_BYTES", 5 << 20)  # chunks that end mid-object
    back = tmp_path / "back"
    assert store.get_file(key, str(back), len(payload) + 1) == len(payload)
    assert back.read_bytes() == payload
    assert store.get_file(key, str(back), 100) == 100  # at most the limit, whatever is stored
    assert back.read_bytes() == payload[:100]
    if backend.exclusive_create:
        other = tmp_path / "other"
        other.write_bytes(b"other bytes")
        with pytest.raises(FileExistsError, match="already exists; keys are create-only"):
            store.put_file(key, str(other))
    pinned = store.pinned_local_file(key)  # a local store's file, read in place
    if pinned is not None:
        assert store.list_prefix("checkpoints") == [key]  # a temp name: no key
        store.delete(key)
        assert Path(pinned).read_bytes() == payload  # its bytes stay though the key is gone
        os.unlink(pinned)


def test_put_accepts_bytearray(backend):
    store = backend.store()
    store.put("k", bytearray(b"abc"))
    assert store.get("k") == b"abc"


def test_put_never_overwrites(backend):
    if not backend.exclusive_create:
        pytest.skip(f"{backend.name} stand-in ignores create-only preconditions")
    store = backend.store()
    store.put("seal", b"first")
    with pytest.raises(FileExistsError, match=r"'seal' in store .* already exists"):
        store.put("seal", b"second")
    assert store.get("seal") == b"first"


def test_get_missing_names_key_and_store(backend):
    store = backend.store()
    with pytest.raises(FileNotFoundError, match=r"'nope/x' in store .* does not exist"):
        store.get("nope/x")


def test_get_many_returns_bytes_or_none_per_key(backend):
    store = backend.store()
    for i in range(5):
        store.put(f"peers/{i}", f"data{i}".encode())
    keys = [f"peers/{i}" for i in range(8)]
    result = store.get_many(keys, limit=100)
    assert list(result) == keys
    assert result == {k: (f"data{k[-1]}".encode() if int(k[-1]) < 5 else None) for k in keys}


def test_list_and_delete_prefix(backend):
    store = backend.store()
    for key in ["rounds/1/a", "rounds/1/b/c", "rounds/2/a", "rounds/10/a", "meta"]:
        store.put(key, b"x")
    assert store.list_prefix("rounds/1") == ["rounds/1/a", "rounds/1/b/c"]
    assert store.list_prefix() == [
        "meta",
        "rounds/1/a",
        "rounds/1/b/c",
        "rounds/10/a",
        "rounds/2/a",
    ]
    assert store.delete_prefix("rounds/1") == 2
    assert store.list_prefix("rounds") == ["rounds/10/a", "rounds/2/a"]
    assert store.delete_prefix("rounds/1") == 0
    assert store.list_prefix("missing") == []


def test_delete_one_key_and_missing_keys_are_fine(backend):
    store = backend.store()
    store.put("leases/1", b"x")
    store.put("leases/2", b"y")
    store.delete("leases/1")
    store.delete("leases/1")
    assert store.list_prefix("leases") == ["leases/2"]


def test_keys_another_deleter_removed_first_are_not_an_error_and_the_rest_go(tmp_path):
    """Two deleters of one prefix (two replicas collecting the same round): a local ``rm`` of
    a list fails on the first path the other removed; the rest are then deleted one by one."""
    store = Store(str(tmp_path))
    for key in ("r/1", "r/2", "r/3"):
        store.put(key, b"x")

    def the_other_deleter_goes_first(key: str) -> bool:  # called after the listing, before rm
        if key == "r/3":
            store.delete("r/1")
        return False  # keep nothing

    assert store.delete_prefix("r", keep=the_other_deleter_goes_first) == 3
    assert store.list_prefix("r") == []


def test_a_local_file_that_changes_size_while_read_is_an_error_naming_the_key(tmp_path):
    """Local objects are written once (a temp file renamed): one that shrinks between its size
    and its bytes was tampered with, and is not returned short."""
    store = Store(str(tmp_path))
    store.put("a/b", b"x" * 100)

    def allocate_as_another_process_truncates(size: int) -> memoryview:
        os.truncate(tmp_path / "a" / "b", 10)  # between the file's size and its reading
        return memoryview(bytearray(size))

    with pytest.raises(StoreError, match=r"'a/b'.*changed size while being read"):
        store.get_into("a/b", allocate_as_another_process_truncates, limit=1000)


def test_the_time_a_store_records_for_a_key_is_its_clocks_and_a_missing_key_is_named(backend):
    """``modified``: what a replica measures its clock against (the stand-ins run on this
    machine, so their clock is ours, to within the stores' whole seconds)."""
    store = backend.store()
    before = time.time()
    store.put("a/b", b"x")
    assert before - 2.0 <= store.modified("a/b") <= time.time() + 1.0
    with pytest.raises(FileNotFoundError, match="'a/c'"):
        store.modified("a/c")


def test_counters_track_requests_and_bytes(backend):
    store = backend.store()
    store.put("a", b"12345")
    store.get("a")
    store.get("a", 0, 2)
    store.get_many(["a", "b"], limit=100)
    stats = store.stats()
    assert (stats.puts, stats.gets, stats.bytes_up, stats.bytes_down) == (1, 4, 5, 12)
    assert (store.stats() - stats).gets == 0


LONG_KEY = "/".join(["a" * 255] * 5)  # every segment allowed, the whole too long


@pytest.mark.parametrize(
    "key", ["", "/a", "a/", "a//b", "../x", ".tmp-x", "-x", "a b", "é", "a" * 256, LONG_KEY]
)
def test_bad_keys_are_rejected_with_the_rule(key):
    with pytest.raises(ValueError, match="is not allowed: use '/'-separated segments of 1-255"):
        check_key(key)


def test_bad_byte_range_is_rejected(tmp_path):
    store = Store(str(tmp_path))
    with pytest.raises(ValueError, match=r"byte range \[5, 2\)"):
        store.get("k", 5, 2)


def test_unsupported_scheme_says_what_is_supported():
    with pytest.raises(ValueError, match="has no create-only write; use a local path"):
        Store("ftp://host/path")


def test_urls_are_redacted_of_credentials():
    assert redact_url("s3://AKIA:secret@bucket/run") == "s3://***@bucket/run"
    assert redact_url("az://c/p?sv=1&sig=SECRET") == "az://c/p"
    store = Store("memory://redact/x?token=SECRET")
    assert "SECRET" not in repr(store)


def test_secret_parameters_are_scrubbed():
    text = "AccountKey=abc==;BlobEndpoint=x; url?X-Amz-Signature=deadbeef&token=t0k&sig=s1g"
    assert scrub_secrets(text) == (
        "AccountKey=***;BlobEndpoint=x; url?X-Amz-Signature=***&token=***&sig=***"
    )


@pytest.mark.parametrize(("first", "second"), [("a", "a/b"), ("c/d", "c")])
def test_local_key_and_folder_clash_says_so(tmp_path, first, second):
    store = Store(str(tmp_path))
    store.put(first, b"x")
    with pytest.raises(StoreError, match="on a local store a key cannot also be a folder of keys"):
        store.put(second, b"y")
    assert store.list_prefix() == [first]


def test_local_store_hides_temp_files_and_leaves_no_empty_folders(tmp_path):
    store = Store(str(tmp_path))
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / ".tmp-abandoned").write_bytes(b"half")  # a writer died mid-write
    store.put("r/a/b", b"x")
    assert store.list_prefix("r") == ["r/a/b"]
    store.delete_prefix("r/a")
    assert not (tmp_path / "r" / "a").exists()
    (tmp_path / "r" / ".tmp-abandoned").unlink()
    assert store.delete_prefix("r") == 0
    assert not (tmp_path / "r").exists()


# -- racing: exactly one winner ------------------------------------------------------------------

RACERS = 16


def _race(url, options, key, racer, barrier, results):
    store = Store(url, storage_options=options)
    barrier.wait()
    try:
        store.put(key, f"racer-{racer}".encode())
        results.put((racer, "won"))
    except FileExistsError:
        results.put((racer, "lost"))
    except Exception as exc:  # reported, so the test shows it instead of hanging
        results.put((racer, f"error: {exc!r}"))


@pytest.mark.parametrize("name", ["path", "s3", "azure"])
def test_racing_creates_have_exactly_one_winner(name, make_backend):
    backend = make_backend(name)
    context = worker_context()
    barrier, results = context.Barrier(RACERS), context.Queue()
    processes = [
        context.Process(
            target=_race,
            args=(backend.url, backend.storage_options, "seal", i, barrier, results),
        )
        for i in range(RACERS)
    ]
    for process in processes:
        process.start()
    outcomes = dict(results.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=30)
    winners = [racer for racer, outcome in outcomes.items() if outcome == "won"]
    assert sorted(outcomes.values()) == ["lost"] * (RACERS - 1) + ["won"], outcomes
    assert backend.store().get("seal") == f"racer-{winners[0]}".encode()


def test_racing_threads_on_memory_have_exactly_one_winner():
    """memory:// is one filesystem per process, so its racers are threads, each with its own
    Store (the lock must be the process's, not the instance's)."""
    barrier, outcomes = threading.Barrier(RACERS), []

    def race(racer: int) -> None:
        store = Store("memory://race-threads")
        barrier.wait()
        try:
            store.put("seal", f"racer-{racer}".encode())
            outcomes.append(racer)
        except FileExistsError:
            pass

    threads = [threading.Thread(target=race, args=(i,)) for i in range(RACERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(outcomes) == 1
    assert Store("memory://race-threads").get("seal") == f"racer-{outcomes[0]}".encode()


def test_a_local_store_follows_no_link_and_reads_only_regular_files(tmp_path, caplog):
    """Planted in a run's folders: a folder that links outside the store, a key that links to
    a file outside it, a FIFO where a manifest goes. Nothing outside is written, read or
    deleted; the FIFO is refused at once instead of blocking the reader."""
    root, outside = tmp_path / "store", tmp_path / "outside"
    (root / "run" / "rounds").mkdir(parents=True)
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep me")
    (root / "run" / "rounds" / "0000000001").symlink_to(outside, target_is_directory=True)
    (root / "run" / "rounds" / "secret").symlink_to(outside / "precious")
    os.mkfifo(root / "run" / "rounds" / "fifo")
    store = Store(f"file://{root}")
    store.put("run/rounds/0000000000/SEAL", b"sealed")
    caplog.set_level(logging.WARNING)
    with pytest.raises(StoreError, match="a symbolic link is on its path"):
        store.put("run/rounds/0000000001/planted", b"x")
    for key in ("run/rounds/0000000001/precious", "run/rounds/secret"):
        with pytest.raises(StoreError, match="a symbolic link is on its path"):
            store.get(key)
    with pytest.raises(StoreError, match="not a regular file"):
        store.get("run/rounds/fifo")
    with pytest.raises(StoreError, match="not a regular file"):
        store.get_into("run/rounds/fifo", lambda size: memoryview(bytearray(size)), limit=10)
    assert store.list_prefix("run") == ["run/rounds/0000000000/SEAL"]
    store.delete_prefix("run/rounds")
    assert (outside / "precious").read_bytes() == b"keep me"
    assert sorted(os.listdir(outside)) == ["precious"]
    assert "skipping 'run/rounds/fifo': not a regular file" in caplog.text


def test_a_key_deleted_between_a_listing_and_its_check_is_gone_not_a_stranger(tmp_path, caplog):
    """A heartbeat deletes its old leases while a keeper lists them: what a listing found and
    is gone by the time it is checked is skipped quietly, not logged as a foreign file."""
    store = Store(str(tmp_path))
    assert not store._is_key("run/members/local-0/0/lease-2")  # listed, then deleted
    assert "skipping" not in caplog.text


# -- overwrite and signed URLs: the status page a keeper rewrites and a person opens ------------

HTML = "text/html; charset=utf-8"
PAGE = "status/index.html"


def test_overwrite_replaces_an_object_whole_and_leaves_create_only_keys_create_only(backend):
    store = backend.store()
    store.overwrite(PAGE, b"<p>first pass</p>", content_type=HTML)
    store.overwrite(PAGE, b"<p>second</p>", content_type=HTML)
    assert store.get(PAGE) == b"<p>second</p>"
    assert store.list_prefix("status") == [PAGE]  # a local store leaves no temp file behind
    store.put("status/clock", b"t")
    if backend.exclusive_create:
        with pytest.raises(FileExistsError, match="create-only"):
            store.put(PAGE, b"<p>a put never overwrites</p>")
        with pytest.raises(FileExistsError, match="create-only"):
            store.put("status/clock", b"u")
    assert store.stats().bytes_up == len(b"<p>first pass</p><p>second</p>t")


def test_a_local_overwrite_never_changes_the_file_a_reader_has_open(tmp_path):
    store = Store(str(tmp_path))
    store.overwrite(PAGE, b"old page")
    with open(tmp_path / PAGE, "rb") as reader:
        store.overwrite(PAGE, b"new page")
        assert reader.read() == b"old page"
    assert store.get(PAGE) == b"new page"


@pytest.mark.parametrize("name", ["path", "file", "s3", "azure", "hf"])
def test_a_signed_url_opens_the_object_with_its_content_type(name, make_backend):
    """What a browser is sent when it opens the link: the page, as HTML. S3 and HF buckets
    sign with SigV4, Azure with a SAS from the account key; a local store gives its file."""
    store = make_backend(name).store()
    store.overwrite(PAGE, b"<p>page</p>", content_type=HTML)
    url = store.sign(PAGE, 300)
    if name in ("path", "file"):
        assert url == (store_root := url.removesuffix(PAGE)) + PAGE
        assert store_root.startswith("file:///")
    else:
        assert ("X-Amz-Signature=" if name != "azure" else "sig=") in url
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.read() == b"<p>page</p>"
        expected = "text/html" if name in ("path", "file") else HTML  # a file's from its name
        assert response.headers["Content-Type"] == expected


def test_gcs_keeps_the_content_type(make_backend):
    """The emulator has no signer, so the object's metadata is read instead; it keeps the
    type without its charset parameter (real GCS keeps the whole value)."""
    backend = make_backend("gcs")
    backend.store().overwrite(PAGE, b"<p>page</p>", content_type=HTML)
    fs, root = fsspec.url_to_fs(backend.url, **backend.storage_options)
    assert fs.info(f"{root}/{PAGE}")["contentType"].startswith("text/html")


@pytest.mark.parametrize("name", ["memory", "gcs"])
def test_a_store_that_cannot_sign_says_so(name, make_backend):
    """memory:// has no URLs; GCS signs only with a service account's key (the emulator has
    none)."""
    store = make_backend(name).store()
    store.overwrite(PAGE, b"<p>page</p>", content_type=HTML)
    with pytest.raises(StoreError, match=rf"sign '{PAGE}' in store .* failed"):
        store.sign(PAGE, 300)


@pytest.mark.parametrize("seconds", [0, 7 * 24 * 3600 + 1])
def test_a_signed_url_lasts_at_most_seven_days(seconds, tmp_path):
    with pytest.raises(ValueError, match="1 to 604800 seconds"):
        Store(str(tmp_path)).sign(PAGE, seconds)
