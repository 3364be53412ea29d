"""The Hugging Face causal-LM task, offline: a tiny Llama-shaped model built from a config, a
tokenizer this test trains with ``tokenizers``, and text this test writes; then a real
2-replica run through ``diloco launch`` and its export as a ``save_pretrained`` folder."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest
import torch

from diloco_anywhere.bucket.store import Store
from diloco_anywhere.data.prepare import prepare, settings_for
from diloco_anywhere.data.source import DataSource, fixed_units
from diloco_anywhere.data.tokenizers import HfTokenizer
from diloco_anywhere.task import TaskContext
from diloco_anywhere.tasks.hf_causal_lm import build, inner_lr_schedule
from support.hf import TINY_LLAMA
from support.runs import diloco, statuses


def _options(corpus) -> dict:
    tokenizer, data = corpus
    config = {**TINY_LLAMA, "vocab_size": 120}
    return {"config": config, "tokenizer": str(tokenizer), "data": str(data), "seq_len": 32,
            "batch_size": 4, "grad_accumulation": 2, "warmup_steps": 3}  # fmt: skip


def _context(corpus, replica_index: int = 0) -> TaskContext:
    """Replica ``replica_index`` of 2, its data a fixed share of the corpus, prepared once for
    the module next to it."""
    source = DataSource("", seed=7, batches_per_unit=5,
                        assign=fixed_units(replica_index, 2, 0, 1),
                        copy=str(corpus[0].parent / "copy"))  # fmt: skip
    return TaskContext(replica_index, 2, 7, torch.device("cpu"), _options(corpus), total_steps=30,
                       data=source)  # fmt: skip


def test_replicas_build_the_same_model_and_resume_their_own_data_at_any_batch(hf_corpus):
    first, again, other = (
        _context(hf_corpus),
        _context(hf_corpus),
        _context(hf_corpus, replica_index=1),
    )
    task, same, neighbour = build(first), build(again), build(other)
    for a, b in zip(task.model.parameters(), same.model.parameters(), strict=True):
        assert torch.equal(a, b)
    from_zero = list(zip(range(6), task.batches(0), strict=False))[5][1]
    from_five = next(same.batches(5))
    assert all(torch.equal(x, y) for a, b in zip(from_zero, from_five, strict=True)
               for x, y in zip(a, b, strict=True))  # fmt: skip
    assert len(from_five) == 2  # grad_accumulation micro-batches
    assert not torch.equal(next(neighbour.batches(5))[0][0], from_five[0][0])
    assert task.tokens_per_batch == 4 * 32 * 2
    assert task.evaluate(task.model) == pytest.approx(neighbour.evaluate(task.model))


def test_a_prepared_corpus_streams_micro_batches_of_the_task_s_tokens(hf_corpus, tmp_path):
    """run.toml's ``[task] data``: the corpus prepared with the task's tokenizer, each inner
    step's sequences cut into its micro-batches; the raw ``data`` option is then refused."""
    tokenizer = HfTokenizer(str(hf_corpus[0]))
    settings = settings_for(tokenizer, text_field="text", heldout_fraction=0.1,
                            shard_tokens=2000, block_tokens=128)  # fmt: skip
    with Store(str(tmp_path / "corpus")) as store:
        prepare(str(hf_corpus[1]), store, tokenizer, settings)
    source = DataSource(str(tmp_path / "corpus"), seed=7, batches_per_unit=5,
                        assign=fixed_units(0, 2, 0, 1))  # fmt: skip
    options = {k: v for k, v in _options(hf_corpus).items() if k != "data"}
    context = TaskContext(0, 2, 7, torch.device("cpu"), options, total_steps=30, data=source)
    task = build(context)
    batch = next(task.batches(3))
    assert [inputs.shape for inputs, _ in batch] == [(4, 32), (4, 32)]
    assert torch.equal(batch[0][0][:, 1:], batch[0][1][:, :-1])  # targets: inputs shifted
    assert int(max(inputs.max() for inputs, _ in batch)) < tokenizer.identity.vocab
    assert math.isfinite(task.evaluate(task.model))
    both = build(TaskContext(0, 2, 7, torch.device("cpu"), _options(hf_corpus), data=source))
    with pytest.raises(ValueError, match=r"task option data and run.toml \[task\] data"):
        next(both.batches(0))
    gone = build(replace(context, options={**options, "eval_data": "x.jsonl"}))
    with pytest.raises(ValueError, match="eval_data is gone: a corpus holds its own held-out"):
        next(gone.batches(0))


def test_the_inner_learning_rate_warms_up_then_follows_a_cosine_over_the_run():
    schedule = inner_lr_schedule(warmup=10, total=110, min_ratio=0.1)
    assert [schedule(step) for step in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert schedule(60) == pytest.approx(0.55)  # half way down the cosine
    assert schedule(110) == pytest.approx(0.1)
    assert schedule(500) == pytest.approx(0.1)


def test_unknown_or_missing_options_are_named(hf_corpus):
    with pytest.raises(ValueError, match=r"task options \['modle'\] unknown"):
        build(TaskContext(0, 1, 0, torch.device("cpu"), {"modle": "x", "data": "y"}))
    with pytest.raises(ValueError, match=r"need `model` .* or `config`"):
        build(TaskContext(0, 1, 0, torch.device("cpu"), {"data": str(hf_corpus[1])}))


def test_a_model_built_from_config_takes_the_tokenizers_vocabulary_and_special_tokens(
    hf_corpus,
):
    """Llama's own default is 32,000 tokens: an embedding sized for another tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_corpus[0])
    options = {**_options(hf_corpus), "config": TINY_LLAMA}
    task = build(TaskContext(0, 2, 7, torch.device("cpu"), options, total_steps=30))
    config = task.model.config
    assert task.model.get_input_embeddings().num_embeddings == config.vocab_size
    assert config.vocab_size == len(tokenizer) < 32_000
    assert config.eos_token_id == tokenizer.eos_token_id == 1  # </s>; Llama's default is 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"config": {**TINY_LLAMA, "vocab_size": 50}},
         "embedding has 50 rows but the tokenizer has 59 tokens: set config.vocab_size to "
         "at least 59, or leave it out"),
        ({"seq_len": 65},
         "seq_len = 65 is more than the model's max_position_embeddings = 64: lower seq_len"),
        ({"tokenizer": None}, "task options need `tokenizer` (a Hub id or folder) for a model "
                              "built from `config`"),
    ],
)  # fmt: skip
def test_a_model_that_cannot_take_the_data_is_refused_before_training(hf_corpus, change, message):
    options = {**_options(hf_corpus), **change}
    options = {key: value for key, value in options.items() if value is not None}
    with pytest.raises(ValueError, match=re.escape(message)):
        build(TaskContext(0, 2, 7, torch.device("cpu"), options, total_steps=30))


@pytest.mark.integration
def test_two_replicas_train_it_and_export_a_save_pretrained_folder(
    hf_corpus, tmp_path, monkeypatch
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.chdir(tmp_path)
    options = _options(hf_corpus)
    config = options.pop("config")
    lines = ['[run]', 'name = "hf"', 'store = "store"', "replicas = 2", "min_replicas = 2",
             "[diloco]", "sync_every = 5", "outer_steps = 3", "inner_lr = 3e-3",
             "[task]", 'entrypoint = "diloco_anywhere.tasks.hf_causal_lm:build"', "eval_every = 1",
             "log_every = 1", "[task.options]",
             *(f"{key} = {json.dumps(value)}" for key, value in options.items()),
             "[task.options.config]",
             *(f"{key} = {json.dumps(value)}" for key, value in config.items())]  # fmt: skip
    (tmp_path / "run.toml").write_text("\n".join(lines) + "\n")
    result = diloco("launch", "--config", "run.toml")
    assert result.exit_code == 0, result.output
    rows = statuses("run.toml")
    assert {(row["state"], row["outer_step"]) for row in rows.values()} == {("done", 3)}
    assert all(row["eval_loss"] < math.log(120) for row in rows.values())  # beats uniform
    # the inner learning rate of the run's last step: its place in warmup + cosine, 15 steps
    last_lr = 3e-3 * inner_lr_schedule(warmup=3, total=15, min_ratio=0.1)(14)
    assert all(row["values"]["lr"] == pytest.approx(last_lr) for row in rows.values())
    exported = diloco("export", "model", "--config", "run.toml")
    assert exported.exit_code == 0, exported.output
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model" / "saved")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model" / "saved")
    inputs = tokenizer("the cat sat on the mat", return_tensors="pt")
    assert model(**inputs).logits.shape[-1] == 120
