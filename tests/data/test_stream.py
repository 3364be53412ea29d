"""Streaming a prepared corpus: one order of its sequences, every one once an epoch whatever the
number of replicas; tokens read by checked ranged reads; units of the order claimed through the
bucket so that no sequence is trained by two sealed contributions and none is skipped."""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from diloco_anywhere.bucket.format.framing import WireFormatError
from diloco_anywhere.bucket.format.layout import RunLayout, contributor
from diloco_anywhere.bucket.format.record import decode_record, encode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.records import Seal
from diloco_anywhere.config import ConfigError
from diloco_anywhere.data import prepare_once as prepare_once_module
from diloco_anywhere.data.claims import Claims, DataPlan, DataPlanError, UnitClaim, agree_on_plan
from diloco_anywhere.data.coverage import read_coverage
from diloco_anywhere.data.order import Order, permute
from diloco_anywhere.data.prepare import PrepareError, prepare, settings_for
from diloco_anywhere.data.prepare_once import PREPARING, Preparing, prepare_once
from diloco_anywhere.data.reader import CorpusNotPreparedError, TokenReader, read_manifest
from diloco_anywhere.data.shards import decode_shard
from diloco_anywhere.data.source import DataSource, fixed_units
from diloco_anywhere.data.tokenizers import ByteTokenizer
from support.runs import RUN_TOML, diloco
from support.votes import voter

BYTES = ByteTokenizer()
WORDS = "the cat sat on a mat while dogs ran far away from home and back again".split()  # noqa: SIM905


@pytest.fixture
def corpus(tmp_path) -> str:
    """About 60 KB of text in 270 documents prepared with the bytes tokenizer, in shards of
    5,000 tokens and blocks of 256."""
    rng = random.Random(0)
    folder = tmp_path / "text"
    folder.mkdir()
    for number in range(3):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) for _ in range(90)]
        (folder / f"part-{number}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in lines)
        )
    settings = settings_for(
        ByteTokenizer(), text_field="text", heldout_fraction=0.1, shard_tokens=5000,
        block_tokens=256,
    )  # fmt: skip
    url = str(tmp_path / "corpus")
    with Store(url) as store:
        prepare(str(folder / "*.jsonl"), store, ByteTokenizer(), settings)
    return url


@pytest.mark.parametrize("size", [1, 2, 3, 5, 16, 17, 1000, 4099])
def test_the_keyed_permutation_is_a_bijection_of_every_size(size):
    for key in (0, 1, 2**63 + 5):
        shuffled = permute(np.arange(size), size, key)
        assert sorted(shuffled.tolist()) == list(range(size))
    if size > 16:
        assert not np.array_equal(
            permute(np.arange(size), size, 1), permute(np.arange(size), size, 2)
        )


def test_every_epoch_visits_every_sequence_once_in_an_order_of_its_own():
    order = Order(chunks=23, chunk_sequences=7, window_chunks=4, seed=5)
    total = order.epoch_sequences
    stream = order.sequences(0, 3 * total)
    epochs = [stream[e * total : (e + 1) * total] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(total))
    assert not np.array_equal(epochs[0], epochs[1])
    # any slice of the stream is the same sequences, however it is cut
    assert np.array_equal(order.sequences(100, 250), stream[100:250])
    assert np.array_equal(Order(23, 7, 4, seed=5).sequences(0, total), epochs[0])
    assert not np.array_equal(Order(23, 7, 4, seed=6).sequences(0, total), epochs[0])


def test_chunks_are_a_block_of_sequences_and_smaller_in_a_small_corpus():
    assert Order.of(2**30, 1024, 2**16, 16, 0).chunk_sequences == 64
    small = Order.of(20_000, 32, 2**16, 16, 0)  # 624 sequences: 2,048 would be one chunk
    assert (small.chunk_sequences, small.chunks) == (2, 312)
    with pytest.raises(ValueError, match="no sequence of seq_len 64"):
        Order.of(60, 64, 2**16, 16, 0)


def test_a_batch_mixes_sequences_from_its_window_of_chunks():
    order = Order(chunks=1000, chunk_sequences=32, window_chunks=16, seed=0)
    batch = order.sequences(0, 64)
    chunks = set((batch // 32).tolist())
    assert len(chunks) >= 8  # 64 sequences drawn from 16 chunks, not 2 runs of one
    assert len(set((order.sequences(0, 16 * 32) // 32).tolist())) == 16


def test_the_reader_returns_the_shards_tokens_by_ranged_reads(corpus):
    store = Store(corpus)
    manifest = read_manifest(store)
    expected = np.concatenate([
        decode_shard(store.get(shard.key), shard.key)[1] for shard in manifest.shards("train")
    ])  # fmt: skip
    reader = TokenReader(store, manifest, "train")
    assert reader.tokens == len(expected) > 10_000
    rng = random.Random(1)
    for _ in range(50):
        start = rng.randrange(reader.tokens)
        stop = min(reader.tokens, start + rng.randrange(1, 12_000))  # across shards too
        assert np.array_equal(reader.read(start, stop), expected[start:stop])
    fresh = Store(corpus)
    TokenReader(fresh, manifest, "train").read(7000, 7100)
    assert fresh.stats().bytes_down < 2 * 256 + 16_000  # a header and a block or two


def test_a_corrupt_block_is_refused_naming_its_shard(corpus):
    store = Store(corpus)
    manifest = read_manifest(store)
    shard = manifest.shards("train")[1]
    path = Path(corpus) / shard.key
    data = bytearray(path.read_bytes())
    data[shard.payload_offset + 300] ^= 0x20  # a byte of block 1
    path.write_bytes(bytes(data))
    reader = TokenReader(store, manifest, "train")
    reader.read(shard.tokens + 10, shard.tokens + 200)  # block 0 of that shard is intact
    with pytest.raises(WireFormatError, match=rf"{shard.key}.*token block 1 is corrupt"):
        reader.read(
            manifest.shards("train")[0].tokens + 260, manifest.shards("train")[0].tokens + 270
        )


def test_a_folder_without_a_manifest_says_how_to_prepare_one(tmp_path):
    with pytest.raises(CorpusNotPreparedError, match="diloco data prepare"):
        read_manifest(Store(str(tmp_path / "nothing")))


def _source(corpus: str, replica: int, replicas: int) -> DataSource:
    return DataSource(corpus, seed=3, batches_per_unit=4,
                      assign=fixed_units(replica, replicas, 0, 1))  # fmt: skip


def test_replicas_with_fixed_shares_train_each_sequence_once_an_epoch(corpus):
    seq_len, batch = 32, 4
    streams = [_source(corpus, replica, 3).open(seq_len, batch, BYTES) for replica in range(3)]
    order = streams[0].order
    rounds = -(-order.epoch_sequences // (3 * 16))
    seen: Counter[bytes] = Counter()
    for stream in streams:
        for rows in _take(stream.batches(0), rounds * 4):
            assert rows.shape == (batch, seq_len + 1)
            assert rows.dtype == torch.int64
            seen.update(bytes(row.numpy().astype(np.uint8)) for row in rows)
    expected = Counter()
    reader = streams[0].train
    for sequence in range(order.epoch_sequences):
        expected[bytes(reader.read(sequence * seq_len, sequence * seq_len + seq_len + 1))] += 1
    # the first epoch whole (and the next one begun): every sequence of it read, as it is
    assert expected - seen == Counter()


def test_a_stream_resumed_mid_round_gives_the_same_batches(corpus):
    stream = _source(corpus, 0, 2).open(16, 3, BYTES)
    from_start = _take(stream.batches(0), 12)
    resumed = _take(_source(corpus, 0, 2).open(16, 3, BYTES).batches(6), 6)
    assert all(torch.equal(a, b) for a, b in zip(from_start[6:], resumed, strict=True))


def test_a_round_s_unit_is_asked_for_only_when_a_batch_of_it_is(corpus):
    """Reading ahead stays within the round: a run that ends after round 1 claims no round 2."""
    asked: list[int] = []

    def units_of(round_: int, count: int) -> list[int]:
        asked.append(round_)
        return [round_] * count

    source = DataSource(corpus, seed=3, batches_per_unit=4, assign=lambda _: units_of)
    batches = source.open(16, 2, BYTES).batches(2)
    _take(batches, 2 + 4)  # the rest of round 0, then round 1
    assert asked == [0, 1]


def test_the_held_out_batches_are_the_same_everywhere_and_from_the_held_out_split(corpus):
    one, other = _source(corpus, 0, 2).open(16, 3, BYTES), _source(corpus, 1, 2).open(16, 3, BYTES)
    evaluation = one.evaluation(4)
    assert [rows.shape for rows in evaluation] == [(3, 17)] * 4
    assert all(torch.equal(a, b) for a, b in zip(evaluation, other.evaluation(4), strict=True))
    train = bytes(one.train.read(0, one.train.tokens))
    assert bytes(evaluation[0][0].numpy().astype(np.uint8)) not in train


def test_a_task_s_tokenizer_unlike_the_corpus_s_is_refused(corpus):
    other = SimpleNamespace(identity=BYTES.identity.model_copy(update={"sha256": "0" * 64}))
    with pytest.raises(ConfigError, match="prepared with tokenizer 'bytes'"):
        _source(corpus, 0, 1).open(16, 2, other)


# -- raw text, prepared once for the run -------------------------------------------------------


def _raw(tmp_path) -> str:
    folder = tmp_path / "raw"
    folder.mkdir(exist_ok=True)
    rng = random.Random(2)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) for _ in range(300)]
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    return str(folder / "*.jsonl")


def _raw_source(raw: str, copy: Path, holder: str = "me-0") -> DataSource:
    return DataSource(raw, seed=0, batches_per_unit=2,
                      assign=fixed_units(0, 1, 0, 1), copy=str(copy), holder=holder)  # fmt: skip


def test_raw_text_is_prepared_into_the_run_s_copy_once_and_checked_after(tmp_path):
    raw, copy = _raw(tmp_path), tmp_path / "store" / "run" / "data" / "corpus"
    first = _raw_source(raw, copy).open(16, 2, BYTES, heldout_fraction=0.1)
    assert first.train.tokens > 10_000
    assert decode_record((copy / PREPARING).read_bytes(), Preparing, key="p").holder == "me-0"
    shards = sorted(p.stat().st_mtime_ns for p in (copy / "train").iterdir())
    again = _raw_source(raw, copy, holder="other-0").open(16, 2, BYTES, heldout_fraction=0.1)
    assert torch.equal(next(again.batches(0)), next(first.batches(0)))
    assert sorted(p.stat().st_mtime_ns for p in (copy / "train").iterdir()) == shards
    (tmp_path / "raw" / "b.jsonl").write_text('{"text": "more"}\n')
    with pytest.raises(PrepareError, match="a corpus never changes under a run"):
        _raw_source(raw, copy).open(16, 2, BYTES, heldout_fraction=0.1)
    with pytest.raises(ValueError, match=r"diloco data prepare .* --tokenizer bytes"):
        DataSource(raw, 0, 2, fixed_units(0, 1, 0, 1)).open(16, 2, BYTES)


def test_a_replica_waits_for_the_one_preparing_then_reads_its_copy(tmp_path):
    raw, copy = _raw(tmp_path), Store(str(tmp_path / "copy"))
    copy.put(PREPARING, encode_record(Preparing(holder="first-0", text_bytes=0)))
    settings = settings_for(BYTES, "text", 0.1, 5000, 256)
    holder = threading.Thread(target=prepare, args=(raw, copy, BYTES, settings))
    holder.start()  # the first replica, preparing as the second one waits
    manifest = prepare_once(raw, copy, BYTES, settings, "second-0")
    holder.join()
    assert manifest == read_manifest(copy)


@pytest.mark.parametrize("lock", ["stalled", "deleted"])
def test_a_stalled_prepare_is_taken_over(tmp_path, monkeypatch, lock):
    """The holder's key unchanged for longer than STALE_SECONDS of the waiter's clock, or gone
    between two looks (deleted by hand, or by a lifecycle rule): either way the waiter takes
    the prepare over, as resuming it writes the same bytes whoever writes them."""
    raw, copy = _raw(tmp_path), Store(str(tmp_path / "copy"))
    copy.put(PREPARING, encode_record(Preparing(holder="gone-0", text_bytes=0)))
    monkeypatch.setattr(prepare_once_module, "POLL_SECONDS", 0.0)
    ticks = iter(range(0, 10**6, 100))  # the waiter's clock: 100 s a look

    def clock() -> int:
        if lock == "deleted":  # after the waiter failed to take it
            (tmp_path / "copy" / PREPARING).unlink(missing_ok=True)
        return next(ticks)

    settings = settings_for(BYTES, "text", 0.1, 5000, 256)
    manifest = prepare_once(raw, copy, BYTES, settings, "second-0", clock=clock)
    assert manifest.tokens("train") > 10_000
    assert manifest == read_manifest(copy)


def test_the_one_preparing_beats_with_how_far_it_got(tmp_path, monkeypatch):
    """Every BEAT_SECONDS the holder rewrites its key with the text it has read so far (what
    the waiters print, and what tells them it still works): at the end, all of it."""
    raw, copy = _raw(tmp_path), Store(str(tmp_path / "copy"))
    monkeypatch.setattr(prepare_once_module, "BEAT_SECONDS", 0.0)  # a beat at every piece
    settings = settings_for(BYTES, "text", 0.1, 5000, 256)
    manifest = prepare_once(raw, copy, BYTES, settings, "first-0")
    beat = decode_record(copy.get(PREPARING, 0, 4096), Preparing, key=PREPARING)
    text_bytes = sum(source.text_bytes for source in manifest.sources)
    assert text_bytes > 10_000
    assert (beat.holder, beat.text_bytes) == ("first-0", text_bytes)


# -- claims ------------------------------------------------------------------------------------

LAYOUT = RunLayout("run")


def _seal(store: Store, round_: int, *names: str) -> None:
    seal = Seal(run="run", round=round_, fragment=0, contributors=tuple(sorted(names)),
                mode="gather", sealed_by=names[0] if names else "x-0")  # fmt: skip
    store.put(LAYOUT.seal(round_, 0), encode_record(seal))


def test_racing_replicas_never_claim_one_unit_twice(tmp_path):
    store = Store(str(tmp_path))
    claimers = [Claims(store, LAYOUT, contributor(f"r{i}", 0), 1) for i in range(6)]
    taken: list[list[int]] = [[] for _ in claimers]

    def claim(index: int) -> None:
        for round_ in range(5):
            taken[index] += claimers[index].units(round_, 2)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(claimers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    units = [unit for mine in taken for unit in mine]
    assert sorted(units) == list(range(6 * 5 * 2))  # each once, none skipped


def test_replicas_that_all_train_every_round_claim_their_own_share_whatever_their_order(
    tmp_path,
):
    """Round r's units are r x 3 .. r x 3 + 2: replica i takes the i-th, whoever comes first,
    so a run is the same each time it is run; a round a replica missed is made up first."""
    store = Store(str(tmp_path))
    claims = [Claims(store, LAYOUT, contributor(f"r{i}", 0), 1, index=i, replicas=3)
              for i in range(3)]  # fmt: skip
    for round_, order in enumerate([(2, 0, 1), (1, 2, 0), (0, 1, 2)]):
        for index in order:
            assert claims[index].units(round_, 1) == [round_ * 3 + index]
    claims[0].units(3, 1), claims[1].units(3, 1)  # replica 2 misses round 3: unit 11 skipped
    assert claims[1].units(4, 1) == [11]  # behind comes first
    assert claims[2].units(4, 1) == [14]
    assert claims[0].units(4, 1) == [12]
    assert claims[0].units(5, 1) == [13]  # round 4's share taken by the catch-up: made up
    units = sorted(state.unit for state in claims[0].states())
    assert units == list(range(units[-1] + 1))  # nothing skipped


def test_a_run_resumed_into_a_new_store_goes_on_from_its_round_s_shares(tmp_path):
    """From a mirror's checkpoint of round 3 into an empty store: round 4's shares, not the
    units of rounds the checkpoint already holds; but a share missed in the store's first
    round is made up."""
    store = Store(str(tmp_path))
    one, two = (Claims(store, LAYOUT, contributor(f"r{i}", 0), 1, index=i, replicas=2)
                for i in range(2))  # fmt: skip
    assert two.units(4, 1) == [9]
    assert one.units(5, 1) == [8]  # replica 0 missed round 4: its share first
    assert two.units(5, 1) == [11]
    assert sorted(state.unit for state in one.states()) == [8, 9, 11]


def test_a_unit_left_out_of_its_round_is_given_back_and_a_trained_one_never(tmp_path):
    store = Store(str(tmp_path))
    a, b = contributor("a", 0), contributor("b", 4)
    first, second = Claims(store, LAYOUT, a, 1), Claims(store, LAYOUT, b, 1)
    assert first.units(0, 1) == [0]
    assert second.units(0, 1) == [1]
    assert first.units(0, 1) == [0]  # a round's claim again (a heal): the same unit
    _seal(store, 0, a)  # b was left out of round 0
    third = Claims(store, LAYOUT, contributor("c", 0), 1)
    assert third.units(1, 2) == [1, 2]  # b's unit first, as its second attempt
    assert store.get(LAYOUT.data_claim(1, 1))
    states = {state.unit: state for state in third.states()}
    assert states[0].trained
    assert (states[1].taken, states[1].attempts) == (True, 2)


def test_a_round_sealed_by_fewer_than_min_replicas_gives_its_units_back(tmp_path):
    store = Store(str(tmp_path))
    a = contributor("a", 0)
    assert Claims(store, LAYOUT, a, 2).units(0, 1) == [0]
    _seal(store, 0, a)
    assert Claims(store, LAYOUT, contributor("b", 0), 2).units(1, 1) == [0]


def test_a_round_whose_seal_no_replica_can_read_gives_its_units_back(tmp_path):
    """Such a round fails on every replica alike (``collective/round.py``): nothing of it
    was applied."""
    store = Store(str(tmp_path))
    a = contributor("a", 0)
    assert Claims(store, LAYOUT, a, 1).units(0, 1) == [0]
    seal = bytearray(encode_record(Seal(run="run", round=0, fragment=0, contributors=(a,),
                                        mode="gather", sealed_by=a)))  # fmt: skip
    seal[-2] ^= 1  # its checksum fails
    store.put(LAYOUT.seal(0, 0), bytes(seal))
    assert Claims(store, LAYOUT, contributor("b", 0), 1).units(1, 1) == [0]


def test_a_replica_planning_the_data_otherwise_is_refused_naming_what_differs(tmp_path):
    store = Store(str(tmp_path))
    plan = DataPlan(corpus="s3://b/c", manifest_crc32c=7, seq_len=128, unit_sequences=64,
                    epoch_sequences=6400, chunk_sequences=4, window_chunks=16, seed=0)  # fmt: skip
    agree_on_plan(store, LAYOUT, plan, voter(0))
    agree_on_plan(store, LAYOUT, plan.model_copy(update={"corpus": "/mnt/c"}), voter(1))  # same
    with pytest.raises(DataPlanError, match=r"seq_len 128 \(here 256\).*another run.name"):
        agree_on_plan(store, LAYOUT, plan.model_copy(update={"seq_len": 256}), voter(2))


def _take(batches, count: int) -> list[torch.Tensor]:
    taken = []
    for batch in batches:
        taken.append(batch)
        if len(taken) == count:
            break
    batches.close()
    return taken


@pytest.mark.integration
@pytest.mark.parametrize("given", ["prepared", "raw"])
def test_a_run_s_replicas_train_each_unit_of_the_order_once(tmp_path, monkeypatch, corpus, given):
    """Two local replicas of the built-in task on a prepared corpus, or on raw text one of
    them prepares into the run's store: every round, each claims a unit of the run's order,
    and the run's sealed rounds hold every unit once, in order."""
    monkeypatch.chdir(tmp_path)
    data = "corpus" if given == "prepared" else _raw(tmp_path)
    text = RUN_TOML.format(replicas=2, outer_steps=3).replace("corpus_bytes = 300000\n", "")
    (tmp_path / "run.toml").write_text(text.replace("[task]\n", f'[task]\ndata = "{data}"\n'))
    result = diloco("launch", "--config", "run.toml")
    assert result.exit_code == 0, result.output
    store = Store(str(tmp_path / "store"))
    copy = tmp_path / "store" / "t" / "data" / "corpus"
    if given == "raw":
        holder = decode_record((copy / PREPARING).read_bytes(), Preparing, key="p").holder
        assert holder.rpartition("-")[0] in ("local-0", "local-1")
    assert copy.exists() == (given == "raw")
    claims = Claims(store, RunLayout("t"), contributor("judge", 0), 2)
    states = claims.states()
    assert [state.unit for state in states] == list(range(6))  # 3 rounds x 2 replicas
    assert all(state.trained and state.attempts == 1 for state in states)
    report = diloco("report", "--config", "run.toml", "--json")
    assert report.exit_code == 0, report.output
    [epoch] = json.loads(report.stdout)["data"]["epochs"]
    assert (epoch["trained_once"], epoch["trained_more"], epoch["lost_tokens"]) == (6 * 20, 0, 0)
    assert "data: epoch 0" in diloco("status", "--config", "run.toml").output


@pytest.mark.integration
def test_a_run_relaunched_with_fewer_replicas_goes_on_where_the_data_was(tmp_path, monkeypatch):
    """Four replicas train 3 rounds; the run is launched again with three for 3 more: the
    second launch's units follow the first's, every one trained once. Each launch's rounds
    wait for all its replicas (min_replicas), so that none is left out on a slow machine."""
    monkeypatch.chdir(tmp_path)
    data = _raw(tmp_path)
    for replicas, outer_steps in ((4, 3), (3, 6)):
        text = RUN_TOML.format(replicas=replicas, outer_steps=outer_steps)
        text = text.replace("corpus_bytes = 300000\n", "")
        text = text.replace("min_replicas = 2", f"min_replicas = {replicas}")
        (tmp_path / "run.toml").write_text(text.replace("[task]\n", f'[task]\ndata = "{data}"\n'))
        result = diloco("launch", "--config", "run.toml")
        assert result.exit_code == 0, result.output
    store = Store(str(tmp_path / "store"))
    claims = Claims(store, RunLayout("t"), contributor("judge", 0), 3).every_claim()
    assert sorted(claim.unit for claim, _ in claims) == list(range(4 * 3 + 3 * 3))
    assert {outcome for _, outcome in claims} == {"trained"}
    rounds = {claim.round for claim, _ in claims if claim.unit >= 12}
    assert rounds == {3, 4, 5}


def _claim(store: Store, unit: int, attempt: int, who: str, round_: int) -> None:
    claim = UnitClaim(unit=unit, attempt=attempt, contributor=who, round=round_, rank=0)
    store.put(LAYOUT.data_claim(unit, attempt), encode_record(claim))


def test_coverage_counts_each_epoch_s_sequences_by_what_came_of_their_claims(tmp_path):
    """Units of 30 sequences, epochs of 100: unit 3 straddles epochs 0 and 1."""
    store = Store(str(tmp_path))
    plan = DataPlan(corpus="c", manifest_crc32c=0, seq_len=8, unit_sequences=30,
                    epoch_sequences=100, chunk_sequences=1, window_chunks=1, seed=0)  # fmt: skip
    agree_on_plan(store, LAYOUT, plan, voter(0))
    a, b = contributor("a", 0), contributor("b", 0)
    _claim(store, 0, 0, a, 0)
    _claim(store, 1, 0, b, 0)  # b left out of round 0: given back
    _claim(store, 1, 1, a, 1)
    _claim(store, 3, 0, a, 2)
    _claim(store, 2, 0, b, 3)  # round 3 not sealed yet
    for round_ in range(3):
        _seal(store, round_, a)
    first, second = read_coverage(store, LAYOUT, 1).epochs
    assert (first.trained_once, first.in_flight, first.not_trained) == (70, 30, 0)
    assert first.lost_tokens == 30 * 8
    assert (second.trained_once, second.not_trained, second.lost_tokens) == (20, 80, 0)
    _claim(store, 0, 1, b, 4)  # what the claims prevent, written by hand: counted, not hidden
    _seal(store, 4, b)
    coverage = read_coverage(store, LAYOUT, 1)
    assert (coverage.epochs[0].trained_more, coverage.epochs[0].trained_once) == (30, 40)
    assert "30 sequences trained twice" in coverage.summary()
    assert read_coverage(Store(str(tmp_path / "none")), LAYOUT, 1) is None
