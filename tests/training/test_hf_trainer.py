"""A Hugging Face ``transformers.Trainer`` as a replica (``DilocoCallback``, docs/api.md): the
page's Trainer script, run exactly as printed as 2 replicas of ``diloco launch``, and a real
Trainer in this process for what a restart resumes and what an error leaves. Offline: a tiny
Llama-shaped model from a config, the tokenizer and text of the ``hf_corpus`` fixture."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    get_scheduler,
)

from diloco_anywhere import DilocoCallback, join
from diloco_anywhere.bucket.format.layout import RunLayout, contributor
from diloco_anywhere.bucket.format.record import decode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.members.departures import Departure
from diloco_anywhere.config import RunConfig, load_config
from diloco_anywhere.contract import EXIT_BAD_CONFIG, EXIT_NOT_SYNCING
from diloco_anywhere.data.claims import Claims
from diloco_anywhere.launching.start.launch import run_metrics
from support.docs import example
from support.hf import TINY_LLAMA
from support.runs import diloco, statuses

SEQ_LEN, BATCH, ACCUMULATION = 32, 4, 2


def _diff_hunks() -> list[tuple[str, str]]:
    """The docs' diff as (plain script's lines, replica's lines) per hunk."""
    diff = example(" from transformers import", "diff")
    hunks = []
    for hunk in diff.split("@@\n"):
        lines = [line or " " for line in hunk.splitlines()]  # an empty line: blank context
        plain = [line[1:] for line in lines if line[0] in " -"]
        replica = [line[1:] for line in lines if line[0] in " +"]
        hunks.append(("\n".join(plain) + "\n", "\n".join(replica) + "\n"))
    return hunks


def _plain_script(script: str) -> str:
    """The Trainer script the docs' diff starts from: the script with each hunk undone."""
    for plain, replica in _diff_hunks():
        assert script.count(replica) == 1, replica  # the diff is the script's, as printed
        script = script.replace(replica, plain)
    return script


@pytest.mark.integration
def test_the_docs_trainer_script_is_every_replica_of_diloco_launch(
    hf_corpus, tmp_path, monkeypatch
):
    tokenizer, data = hf_corpus
    shutil.copytree(tokenizer, tmp_path / "tokenizer")
    shutil.copy(data, tmp_path / "data.jsonl")
    script = example("# hf_train.py")
    (tmp_path / "hf_train.py").write_text(script)
    (tmp_path / "run.toml").write_text(example("# hf_train.py's run.toml", "toml"))
    monkeypatch.chdir(tmp_path)
    assert "diloco_anywhere" not in _plain_script(script)  # the diff is all a replica adds
    result = diloco("launch", "--config", "run.toml")
    assert result.exit_code == 0, result.output
    rows = statuses("run.toml")
    assert {(row["state"], row["outer_step"]) for row in rows.values()} == {("done", 3)}
    total = load_config("run.toml").diloco.total_steps
    for replica in rows:  # the Trainer took the run's inner steps, no more
        log = (tmp_path / ".diloco" / "trainer" / "logs" / f"{replica}.log").read_text()
        assert f"{replica} took {total} optimizer steps" in log
    metrics = run_metrics(load_config("run.toml")).read()
    fingerprints = {
        (sync.outer_step, sync.fingerprint)
        for replica in metrics.values()
        for sync in replica.syncs
        if sync.committed
    }
    assert sorted(step for step, _ in fingerprints) == [1, 2, 3]  # the same weights at each
    for replica in metrics.values():  # the Trainer's logged loss, every logging_steps
        assert [line.step for line in replica.steps] == [3, 6, 9, 12, 15]
        assert set(replica.steps[0].values) == {"learning_rate", "grad_norm"}
        assert replica.steps[-1].loss < replica.steps[0].loss - 0.3
    # the export loads with from_pretrained, no code of ours: the callback added config.json
    assert diloco("export", "exported", "--config", "run.toml").exit_code == 0
    model, info = LlamaForCausalLM.from_pretrained("exported", output_loading_info=True)
    assert [info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")] == [
        set(), set(), set()
    ]  # fmt: skip
    assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(tokenizer))
    exported = load_file("exported/model.safetensors")
    assert exported.keys() == dict(model.named_parameters()).keys()
    assert all(torch.equal(p, exported[name]) for name, p in model.named_parameters())


@pytest.mark.integration
def test_a_trainer_on_the_run_s_data_trains_each_unit_of_it_once(hf_corpus, tmp_path, monkeypatch):
    """The docs' Trainer on ``DilocoCallback.dataset``: raw text one replica prepares with the
    script's tokenizer, every round's unit claimed and trained once by a sealed contribution."""
    tokenizer, data = hf_corpus
    shutil.copytree(tokenizer, tmp_path / "tokenizer")
    shutil.copy(data, tmp_path / "data.jsonl")
    (tmp_path / "hf_train_stream.py").write_text(example("# hf_train_stream.py"))
    run = example("# hf_train.py's run.toml", "toml").replace("hf_train.py", "hf_train_stream.py")
    (tmp_path / "run.toml").write_text(run.replace("[task]", '[task]\ndata = "data.jsonl"'))
    monkeypatch.chdir(tmp_path)
    result = diloco("launch", "--config", "run.toml")
    assert result.exit_code == 0, result.output
    assert {row["state"] for row in statuses("run.toml").values()} == {"done"}
    store = Store(str(tmp_path / "store"))
    claims = Claims(store, RunLayout("trainer"), contributor("judge", 0), 2).every_claim()
    trained = sorted(claim.unit for claim, outcome in claims if outcome == "trained")
    assert trained == list(range(2 * 3))  # 2 replicas x 3 rounds, each unit once
    # accelerate's loader reads a batch ahead: a claim on the round after the run's last,
    # which a longer run would seal without it and so give back
    assert {(claim.round, outcome) for claim, outcome in claims if claim.unit >= 6} <= {
        (3, "taken")
    }
    metrics = run_metrics(load_config("run.toml")).read()
    for replica in metrics.values():
        assert replica.steps[-1].loss < replica.steps[0].loss


@pytest.mark.integration
def test_a_trainer_paced_above_sync_every_goes_past_max_steps_to_the_run_s_end(
    hf_corpus, tmp_path, monkeypatch
):
    """``pace = "time"`` with rounds long enough for ``max_round_steps`` (4 x 5): the Trainer's
    ``max_steps`` (15) sets what its schedule spans, the run decides when it ends (30 steps:
    the round after the first was planned before anything was measured, its first batch read
    ahead), and every unit of the data is still trained once."""
    tokenizer, data = hf_corpus
    shutil.copytree(tokenizer, tmp_path / "tokenizer")
    shutil.copy(data, tmp_path / "data.jsonl")
    (tmp_path / "hf_train_stream.py").write_text(example("# hf_train_stream.py"))
    run = example("# hf_train.py's run.toml", "toml").replace("hf_train.py", "hf_train_stream.py")
    run = run.replace("[task]", '[task]\ndata = "data.jsonl"')
    run = run.replace("outer_steps = 3", 'outer_steps = 3\npace = "time"\nround_seconds = 600.0')
    (tmp_path / "run.toml").write_text(run)
    monkeypatch.chdir(tmp_path)
    result = diloco("launch", "--config", "run.toml")
    assert result.exit_code == 0, result.output
    assert {row["state"] for row in statuses("run.toml").values()} == {"done"}
    metrics = run_metrics(load_config("run.toml")).read()
    for replica in metrics.values():
        assert [sync.round_steps for sync in replica.syncs] == [5, 5, 20]
    store = Store(str(tmp_path / "store"))
    claims = Claims(store, RunLayout("trainer"), contributor("judge", 0), 2).every_claim()
    trained = sorted(claim.unit for claim, outcome in claims if outcome == "trained")
    assert trained == list(range(2 * (5 + 5 + 20)))  # units of one step, each once


def _run(tmp_path, outer_steps: int) -> RunConfig:
    """One replica's run in ``tmp_path``'s store, 5 inner steps per outer step."""
    return RunConfig.model_validate({
        "run": {"name": "trainer", "store": str(tmp_path / "store"), "replicas": 1,
                "min_replicas": 1},
        "diloco": {"sync_every": 5, "outer_steps": outer_steps},
        "task": {"log_every": 1},
    })  # fmt: skip


def _trainer(corpus, tmp_path, callbacks: list[TrainerCallback], **settings) -> Trainer:
    """A Trainer as a user writes one: a tiny Llama, the corpus in blocks of SEQ_LEN tokens;
    ``settings``: its ``TrainingArguments`` other than these."""
    tokenizer = AutoTokenizer.from_pretrained(corpus[0])
    texts = [json.loads(line)["text"] for line in corpus[1].read_text().splitlines()]
    ids = tokenizer(tokenizer.eos_token.join(texts))["input_ids"]
    blocks = [ids[i : i + SEQ_LEN] for i in range(0, len(ids) - SEQ_LEN, SEQ_LEN)]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "vocab_size": len(tokenizer)}))
    args = TrainingArguments(**{
        "output_dir": str(tmp_path / "trainer"), "per_device_train_batch_size": BATCH,
        "gradient_accumulation_steps": ACCUMULATION, "learning_rate": 3e-3,
        "lr_scheduler_type": "cosine", "warmup_steps": 3, "logging_steps": 1,
        "save_strategy": "no", "report_to": "none", "use_cpu": True, **settings,
    })  # fmt: skip
    dataset = [{"input_ids": block, "labels": block} for block in blocks]
    return Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)


class LearningRates(TrainerCallback):
    """The learning rate of each optimizer step, as the optimizer takes it."""

    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_pre_optimizer_step(self, args, state, control, *, optimizer, **_):
        self.rates.append(optimizer.param_groups[0]["lr"])


class FailsAtStep(TrainerCallback):
    """The script's own error, inside ``trainer.train()``; keeps the optimizer it stepped."""

    def on_step_end(self, args, state, control, *, optimizer, **_):
        if state.global_step == 2:
            self.optimizer = optimizer
            raise RuntimeError("the script's own error at step 2")


def _train_as_replica(
    config: RunConfig, corpus, tmp_path, *callbacks: TrainerCallback, **settings
) -> tuple[Trainer, DilocoCallback]:
    """The Trainer trained as local-0 of ``config``'s run, with ``callbacks`` after DiLoCo's
    (``settings``: its ``TrainingArguments``, as ``_trainer``)."""
    with join(config, replica_id="local-0") as replica:
        diloco = DilocoCallback(replica, tokens_per_step=BATCH * ACCUMULATION * SEQ_LEN)
        trainer = _trainer(corpus, tmp_path, [diloco, *callbacks], **settings)
        trainer.train()
    return trainer, diloco


def _cosine(total: int) -> list[float]:
    """The Trainer's cosine schedule over ``total`` steps, step by step."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=3e-3)
    schedule = get_scheduler("cosine", optimizer, num_warmup_steps=3, num_training_steps=total)
    rates = []
    for _ in range(total):
        rates.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    return rates


def test_a_restarted_trainer_resumes_the_runs_schedule_and_stops_when_the_run_is_done(
    hf_corpus, tmp_path
):
    """A run of 1 outer step, then the same run given 2: the Trainer that joins it heals to
    outer step 1 and trains inner steps 5 to 9 only, at the learning rates of a schedule over
    all 10."""
    first, _ = _train_as_replica(_run(tmp_path, outer_steps=1), hf_corpus, tmp_path)
    assert (first.state.global_step, first.args.max_steps) == (5, 5)
    rates = LearningRates()
    again, diloco = _train_as_replica(_run(tmp_path, outer_steps=2), hf_corpus, tmp_path, rates)
    assert diloco.training.start_step == 5
    assert (again.state.global_step, again.args.max_steps) == (5, 10)  # stopped by the run
    assert rates.rates == pytest.approx(_cosine(10)[5:])
    assert diloco.training.result().outer_steps == 2


def test_an_error_inside_train_unwinds_diloco_and_is_the_replicas_failure(hf_corpus, tmp_path):
    config, failing = _run(tmp_path, outer_steps=2), FailsAtStep()
    with pytest.raises(RuntimeError, match="own error at step 2"):
        _train_as_replica(config, hf_corpus, tmp_path, failing)
    inner = failing.optimizer.optimizer  # the torch optimizer in accelerate's wrapper
    assert not inner._optimizer_step_pre_hooks  # DiLoCo's hooks, removed as it was left
    assert not inner._optimizer_step_post_hooks
    events = [(e.event, e.detail) for e in run_metrics(config).read()["local-0"].events]
    assert events[-1] == ("failed", "RuntimeError: the script's own error at step 2")


def test_a_trainer_without_the_callback_is_stopped_within_two_rounds_naming_it(hf_corpus, tmp_path):
    """The issue's Trainer script that joined but never synced: it trained all its epochs
    alone, then failed with advice about `replica.diloco`. Now its 11th optimizer step (two
    rounds of 5, and one) stops it with exit 4, naming the callback."""
    config = _run(tmp_path, outer_steps=4)
    steps = LearningRates()
    with pytest.raises(SystemExit) as ended, join(config, replica_id="local-0"):
        _trainer(hf_corpus, tmp_path, [steps]).train()
    assert ended.value.code == EXIT_NOT_SYNCING
    assert len(steps.rates) == 11  # stopped right after its 11th step, not 120 steps later
    [event] = [e for e in run_metrics(config).read()["local-0"].events if e.event == "failed"]
    assert event.detail.startswith("TrainingOutsideDilocoError: this replica joined the run and "
                                   "took 11 optimizer steps, but none under DiLoCo")  # fmt: skip
    assert "pass `callbacks=[DilocoCallback(replica)]` to the Trainer" in event.detail


def _train_added_late(config: RunConfig, corpus, tmp_path) -> None:
    with join(config, replica_id="local-0") as replica:
        trainer = _trainer(corpus, tmp_path, [])
        trainer.add_callback(DilocoCallback(replica, tokens_per_step=1))
        trainer.train()


def test_a_callback_added_after_the_trainer_is_built_is_refused_saying_where_it_goes(
    hf_corpus, tmp_path
):
    """``on_init_end`` is past: the Trainer's scheduler would span its own steps, not the run's."""
    config = _run(tmp_path, outer_steps=1)
    with pytest.raises(ValueError, match=r"plans \d+ optimizer steps and the run 5: give"):
        _train_added_late(config, hf_corpus, tmp_path)
    events = [e.event for e in run_metrics(config).read()["local-0"].events]
    assert events == ["failed"]


def _two_replicas(tmp_path, outer_steps: int = 1) -> RunConfig:
    """A run of two replicas that seals a round with one: the other may be refused."""
    return RunConfig.model_validate({
        "run": {"name": "trainer", "store": str(tmp_path / "store"), "replicas": 2,
                "min_replicas": 1},
        "diloco": {"sync_every": 5, "outer_steps": outer_steps},
        "sync": {"grace": 1.0},
        "task": {"log_every": 1},
    })  # fmt: skip


SAVES = {"save_strategy": "steps", "save_steps": 5}  # a checkpoint of its own every round


def _build_as(
    config: RunConfig, replica_id: str, corpus, tmp_path, *callbacks: TrainerCallback, **settings
) -> None:
    """Join as ``replica_id`` and build its Trainer (``settings``: as ``_trainer``), no more."""
    with join(config, replica_id=replica_id) as replica:
        diloco = DilocoCallback(replica, tokens_per_step=1)
        _trainer(corpus, tmp_path, [diloco, *callbacks], **settings)


def test_a_second_replica_given_the_first_s_output_dir_is_refused_as_its_trainer_is_built(
    hf_corpus, tmp_path
):
    """The issue's script that writes to a shared output folder: local replicas all run in
    run.toml's folder, so ``output_dir="out"`` in each is one folder. The second Trainer built
    on it stops its replica at once, before any step (exit 2, final: no restart helps), naming
    the folder, both replicas and the fix; the first trains on and saves there alone."""
    config, shared = _two_replicas(tmp_path), str(tmp_path / "out")
    with join(config, replica_id="local-0") as first:
        diloco = DilocoCallback(first, tokens_per_step=BATCH * ACCUMULATION * SEQ_LEN)
        trainer = _trainer(hf_corpus, tmp_path, [diloco], output_dir=shared, **SAVES)
        steps, began = LearningRates(), time.monotonic()
        with pytest.raises(SystemExit) as ended:
            _build_as(config, "local-1", hf_corpus, tmp_path, steps, output_dir=shared, **SAVES)
        assert ended.value.code == EXIT_BAD_CONFIG
        assert time.monotonic() - began < 30  # refused as its Trainer was built
        assert steps.rates == []  # before any step
        trainer.train()
    events = run_metrics(config).read()
    [refusal] = [e.detail for e in events["local-1"].events if e.event == "failed"]
    assert refusal.startswith(f"SharedOutputDirError: output_dir '{shared}' is replica local-0's")
    assert "this replica, local-1, was given it too" in refusal
    assert f'TrainingArguments(output_dir=os.path.join("{shared}", replica.replica_id))' in refusal
    assert f"`--output_dir {shared}/$DILOCO_REPLICA_ID`" in refusal
    store = Store(str(tmp_path / "store"))
    departure = store.get(RunLayout("trainer").departure("local-1"), 0, 1 << 16)
    assert decode_record(departure, Departure, key="local-1").final  # the others know: for good
    assert events["local-0"].events[-1].event == "done"  # the first was not stopped by it
    assert (tmp_path / "out" / "checkpoint-5").is_dir()


def test_a_restarted_replica_takes_its_own_output_dir_again_and_others_have_theirs(
    hf_corpus, tmp_path
):
    """A restart of the replica that claimed ``output_dir`` finds its own claim, resumes, and
    saves there; folders of the replica's id (``f"out/{replica.replica_id}"``) are free for
    each; a Trainer that saves no checkpoint (``save_strategy="no"``, docs/api.md's script)
    claims nothing."""
    _train_as_replica(
        _run(tmp_path, outer_steps=1), hf_corpus, tmp_path, output_dir=str(tmp_path / "out"),
        **SAVES,
    )  # fmt: skip
    _, diloco = _train_as_replica(
        _run(tmp_path, outer_steps=2), hf_corpus, tmp_path, output_dir=str(tmp_path / "out"),
        **SAVES,
    )  # fmt: skip
    assert diloco.training.result().outer_steps == 2
    assert (tmp_path / "out" / "checkpoint-5").is_dir()  # its own, saved again after the restart
    config = _two_replicas(tmp_path / "two")
    with join(config, replica_id="local-0") as one, join(config, replica_id="local-1") as other:
        for replica in (one, other):
            output_dir = str(tmp_path / "out" / replica.replica_id)
            _trainer(hf_corpus, tmp_path, [DilocoCallback(replica, tokens_per_step=1)],
                     output_dir=output_dir, **SAVES)  # fmt: skip
        for replica in (one, other):  # no checkpoint saved: nothing to claim, nothing refused
            callback = DilocoCallback(replica, tokens_per_step=1)
            _trainer(hf_corpus, tmp_path, [callback], output_dir=str(tmp_path / "shared"))
    assert not (tmp_path / ".diloco-claims" / "shared").exists()
