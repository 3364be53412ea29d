"""A third-party training script, as tests/replica/test_third_party_script.py runs it: a
character-level GPT written the way nanoGPT and minGPT are (``model.py`` beside ``train.py``),
not the way this project's own tasks are. Its features are the ones that once surprised a
replica: a head tied to the token embedding, gradient accumulation with an fp16-style skipped
step, ``torch.compile``, the global RNG seeded per rank for the data, an evaluation that draws
its batches from the global RNG, logging every few steps, its own cosine schedule.
"""

MODEL = '''
"""model.py: a character-level GPT, nanoGPT style."""
import torch
from torch import nn
from torch.nn import functional as F

TEXT = " ".join(
    ["the cat sat on the mat", "a dog ran under the log", "big red birds sing slowly"] * 40
)
VOCAB = sorted(set(TEXT))
DATA = torch.tensor([VOCAB.index(c) for c in TEXT])
TRAIN, VAL = DATA[: int(0.9 * len(DATA))], DATA[int(0.9 * len(DATA)) :]
BLOCK, BATCH = 16, 8


class CharGPT(nn.Module):
    def __init__(self, vocab=len(VOCAB), width=32, heads=2):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, width)
        self.position_embedding = nn.Embedding(BLOCK, width)
        self.norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # weight tying
        mask = torch.triu(torch.ones(BLOCK, BLOCK, dtype=torch.bool), 1)
        self.register_buffer("mask", mask, persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        x = self.token_embedding(idx) + self.position_embedding(torch.arange(idx.shape[1]))
        h = self.norm(x)
        x = x + self.attention(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        logits = self.lm_head(x + self.mlp(self.norm(x)))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def get_batch(split):
    data = TRAIN if split == "train" else VAL
    ix = torch.randint(len(data) - BLOCK - 1, (BATCH,))
    x = torch.stack([data[i : i + BLOCK] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + BLOCK] for i in ix])
    return x, y


@torch.no_grad()
def estimate_loss(model, iters=4):
    model.eval()
    losses = [model(*get_batch("val"))[1].item() for _ in range(iters)]
    model.train()
    return sum(losses) / len(losses)
'''

TRAIN = '''
"""train.py: nanoGPT's loop, made a replica (the lines marked `# diloco`)."""
import math
import os
import signal
from pathlib import Path

import torch

import diloco_anywhere  # diloco
from model import BATCH, BLOCK, CharGPT, estimate_loss, get_batch

gradient_accumulation_steps = 2
learning_rate, min_lr, warmup_iters = 3e-3, 3e-4, 4

replica = diloco_anywhere.join()  # diloco
max_iters = replica.total_steps  # diloco: the run's inner steps span the schedule
torch.manual_seed(1337)  # the same initial weights on every replica
model = CharGPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
model = torch.compile(model, backend="eager")
torch.manual_seed(1337 + replica.index)  # seed_offset per rank: each replica its own batches


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    ratio = (it - warmup_iters) / max(1, max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


tokens_per_iter = gradient_accumulation_steps * BATCH * BLOCK
training = replica.start(  # diloco
    model, optimizer, tokens_per_step=tokens_per_iter, evaluate=estimate_loss
)
overflowed = set()
for iter_num in training.steps():  # diloco: was `while iter_num < max_iters`
    if replica.index == 1 and iter_num == 20 and not Path("killed").exists():
        Path("killed").touch()  # the test's fault: a platform killing the replica once
        os.kill(os.getpid(), signal.SIGKILL)
    for group in optimizer.param_groups:
        group["lr"] = get_lr(iter_num)
    for micro_step in range(gradient_accumulation_steps):
        X, Y = get_batch("train")
        logits, loss = model(X, Y)
        (loss / gradient_accumulation_steps).backward()
    if iter_num % 9 == 4 and iter_num not in overflowed:  # as GradScaler skips an inf step
        overflowed.add(iter_num)
        optimizer.zero_grad(set_to_none=True)
        continue
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if iter_num % 3 == 0:
        training.log(loss.detach(), lr=get_lr(iter_num))
replica.finish()  # diloco
'''
