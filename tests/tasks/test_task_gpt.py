"""The built-in byte-level GPT task: identical starts, sharded data, a real learning signal."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco_anywhere.bucket.format.record import encode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.data.manifest import MANIFEST, SETTINGS, Manifest
from diloco_anywhere.data.prepare import settings_for
from diloco_anywhere.data.source import DataSource, fixed_units
from diloco_anywhere.data.tokenizers import ByteTokenizer
from diloco_anywhere.task import Task, TaskContext
from diloco_anywhere.tasks.gpt import build

COPIES = Path()  # where ``make`` prepares each corpus, once for the module


@pytest.fixture(autouse=True, scope="module")
def _copies(tmp_path_factory) -> None:
    """One folder per corpus for the whole module, as a run's store holds its copy."""
    global COPIES
    COPIES = tmp_path_factory.mktemp("copies")


def make(replica: int = 0, replicas: int = 2, seed: int = 0, **options: Any) -> Task:
    """The task as replica ``replica`` of ``replicas`` builds it, its data a fixed share."""
    corpus = str(options.get("corpus", "stdlib"))
    copy = COPIES / hashlib.sha256(corpus.encode()).hexdigest()[:12]
    source = DataSource("", seed=seed, batches_per_unit=4,
                        assign=fixed_units(replica, replicas, 0, 1), copy=str(copy))  # fmt: skip
    return build(TaskContext(replica, replicas, seed, torch.device("cpu"), options, data=source))


def first_batches(task: Task, count: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = task.batches(0)
    return [next(batches) for _ in range(count)]


def test_replicas_start_from_identical_weights() -> None:
    torch.manual_seed(123)  # the global RNG must not matter
    first = make(replica=0, seed=5).model.state_dict()
    second = make(replica=1, seed=5).model.state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    other_seed = make(replica=0, seed=6).model.state_dict()
    assert not torch.equal(first["token_embedding.weight"], other_seed["token_embedding.weight"])


def test_batches_differ_by_replica_and_repeat_by_seed() -> None:
    replica0, replica0_again, replica1 = make(0), make(0), make(1)
    batches = first_batches(replica0)
    for (inputs, targets), (inputs_again, targets_again) in zip(
        batches, first_batches(replica0_again), strict=True
    ):
        assert torch.equal(inputs, inputs_again)
        assert torch.equal(targets, targets_again)
    assert not torch.equal(batches[0][0], next(replica1.batches(0))[0])
    inputs, targets = batches[0]
    assert inputs.shape == targets.shape == (16, 64)
    assert inputs.dtype == targets.dtype == torch.long
    assert replica0.tokens_per_batch == 16 * 64


def _lines(path: Path, count: int = 300) -> Path:
    path.write_text("".join(f'{{"text": "line {i}: the quick brown fox"}}\n' for i in range(count)))
    return path


def test_rows_are_the_corpus_s_bytes_and_targets_the_next_ones(tmp_path: Path) -> None:
    corpus = _lines(tmp_path / "lines.jsonl")
    text = b"\n".join(f"line {i}: the quick brown fox".encode() for i in range(300))
    for inputs, targets in first_batches(make(corpus=str(corpus), seq_len=16, batch_size=8)):
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        for row in torch.cat([inputs, targets[:, -1:]], dim=1):
            assert bytes(row.tolist()) in text + b"\n"
    inputs, targets = next(make().batches(0))  # and on the stdlib corpus
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_untrained_eval_is_shared_and_near_uniform() -> None:
    first, second = make(replica=0, seed=3), make(replica=1, seed=3)
    loss = first.evaluate(first.model)
    assert loss == second.evaluate(second.model)
    assert loss == pytest.approx(math.log(256), abs=0.5)
    assert first.model.training


def test_training_lowers_the_loss() -> None:
    task = make(seed=1)
    optimizer = torch.optim.AdamW(task.model.parameters(), lr=3e-3)
    eval_before = task.evaluate(task.model)
    losses, batches = [], task.batches(0)
    for _ in range(40):
        loss = task.loss(task.model, next(batches))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
    assert task.evaluate(task.model) < eval_before - 0.5


def test_batches_start_anywhere() -> None:
    """A replica that resumes at batch 5 gets exactly the batches a replica that never stopped
    gets from its sixth on (healing resumes data at the round)."""
    task = make()
    from_start = first_batches(task, 8)
    resumed = task.batches(5)
    for inputs, targets in from_start[5:]:
        again_inputs, again_targets = next(resumed)
        assert torch.equal(inputs, again_inputs)
        assert torch.equal(targets, again_targets)


def test_custom_corpus_file(tmp_path: Path) -> None:
    task = make(corpus=str(_lines(tmp_path / "text.jsonl")), seq_len=32, batch_size=4,
                eval_batches=2)  # fmt: skip
    inputs, _ = next(task.batches(0))
    assert inputs.shape == (4, 32)
    assert math.isfinite(task.evaluate(task.model))


def test_missing_corpus_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.txt"
    with pytest.raises(ValueError, match=r"nowhere\.txt: no file there"):
        next(make(corpus=str(missing)).batches(0))


def test_a_corpus_too_small_for_a_sequence_says_so(tmp_path: Path) -> None:
    corpus = _lines(tmp_path / "small.jsonl", count=3)
    with pytest.raises(ValueError, match="no sequence of seq_len 64"):
        next(make(corpus=str(corpus)).batches(0))


def test_a_corpus_prepared_with_another_tokenizer_or_given_twice_is_refused(tmp_path) -> None:
    """The byte-level model reads bytes: a corpus of another tokenizer's ids is refused before
    training, as is a `corpus` option beside run.toml's [task] data."""
    (tmp_path / "text.jsonl").write_text("".join(f'{{"text": "line {i}"}}\n' for i in range(99)))
    settings = settings_for(ByteTokenizer(), text_field="text", heldout_fraction=0.1,
                            shard_tokens=4096, block_tokens=64)  # fmt: skip
    tampered = settings.model_copy(update={"tokenizer": settings.tokenizer.model_copy(
        update={"name": "gpt2", "sha256": "1" * 64})})  # fmt: skip
    with Store(str(tmp_path / "corpus")) as store:
        store.put(SETTINGS, encode_record(tampered))
        store.put(MANIFEST, encode_record(Manifest(settings=tampered, sources=())))
    source = DataSource(str(tmp_path / "corpus"), seed=0, batches_per_unit=2,
                        assign=fixed_units(0, 1, 0, 1))  # fmt: skip
    context = TaskContext(0, 1, 0, torch.device("cpu"), {}, data=source)
    with pytest.raises(ValueError, match="prepared with tokenizer 'gpt2'"):
        next(build(context).batches(0))
    both = build(TaskContext(0, 1, 0, torch.device("cpu"), {"corpus": "stdlib"}, data=source))
    with pytest.raises(ValueError, match=r"\['corpus'\] and run.toml \[task\] data"):
        next(both.batches(0))
