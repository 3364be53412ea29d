"""What ``diloco bench gpu`` runs: its checks in order, their time limits, and the sizes per
device: on a GPU the sizes ../shared/GPU-CHECKS.md names (a Llama of about 100M parameters,
1 GiB through the codecs, a 4 GiB sync), on the CPU tiny ones, so that ``make test`` runs
every line of the script in about a minute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sizes:
    """How big each check runs."""

    llama: dict[str, Any]  # the Hugging Face task's config table, beside its tokenizer's vocab
    vocab: int  # tokens of the byte-level BPE trained on the corpus
    corpus_bytes: int  # standard-library source text the corpus takes
    seq_len: int
    batch_size: int
    sync_every: int  # H of the replica check
    outer_steps: int
    log_every: int
    codec_bytes: int  # float32 bytes through each codec
    codec_repeats: int
    sync_bytes: int  # float32 bytes of the synced pseudo-gradient
    sync_rounds: int
    gpt_preset: str  # the built-in GPT of the FSDP and compile checks
    gpt_batch: int
    gpt_sync_every: int
    gpt_outer_steps: int


SIZES = {
    "cuda": Sizes(
        llama={
            "model_type": "llama", "hidden_size": 768, "intermediate_size": 2048,
            "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 12,
            "max_position_embeddings": 1024,
        },  # 85M in the layers, 13M in the untied embeddings of 8,192 tokens
        vocab=8192, corpus_bytes=8 << 20, seq_len=512, batch_size=16, sync_every=50,
        outer_steps=4, log_every=10, codec_bytes=1 << 30, codec_repeats=3,
        sync_bytes=4 << 30, sync_rounds=2, gpt_preset="base", gpt_batch=32,
        gpt_sync_every=20, gpt_outer_steps=3,
    ),
    "cpu": Sizes(
        llama={
            "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
            "max_position_embeddings": 64,
        },
        vocab=320, corpus_bytes=1 << 20, seq_len=32, batch_size=4, sync_every=6,
        outer_steps=4, log_every=2, codec_bytes=8 << 20, codec_repeats=1,
        sync_bytes=16 << 20, sync_rounds=2, gpt_preset="tiny", gpt_batch=4,
        gpt_sync_every=4, gpt_outer_steps=2,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Check:
    name: str
    title: str
    target: str  # module:function, called with (device, sizes, work folder)
    seconds: float  # its time limit on a GPU (an H100 or H200); the CPU's sizes take less


CHECKS = (
    Check("replica", "2 replicas of a Llama (Hugging Face task), int8, bf16 autocast, H 50",
          "diloco_anywhere.bench.gpu.replica_run:check", 170),
    Check("codecs", "int8 and sparse encode and decode of a pseudo-gradient on the device",
          "diloco_anywhere.bench.gpu.device_codecs:check", 80),
    Check("sync", "a sync from device tensors: 2 replica processes, host memory and time",
          "diloco_anywhere.bench.gpu.device_sync:check", 100),
    Check("fsdp", "FSDP2 over NCCL, one rank, against the same run on the CPU",
          "diloco_anywhere.bench.gpu.fsdp_agreement:check", 110),
    Check("compile", "torch.compile of the built-in loop: trains, resumes, exports",
          "diloco_anywhere.bench.gpu.compiled_loop:check", 160),
)  # fmt: skip
CHECK_NAMES = tuple(check.name for check in CHECKS)
# A check's limit is its GPU seconds times this: the CPU's tiny sizes take less work but start
# as many processes, and a CI machine's two cores may be busy with other tests meanwhile.
LIMIT_SCALE = {"cuda": 1.0, "cpu": 3.0}
