"""Text and a tokenizer for the Hugging Face task with nothing downloaded: the machine's own
standard-library sources as documents (as the built-in GPT's corpus), and a byte-level BPE
trained on them with ``tokenizers`` (GPT-2's scheme: any text encodes, no unknown token)."""

from __future__ import annotations

import json
from pathlib import Path

from diloco_anywhere.data import stdlib
from diloco_anywhere.data.stdlib import stdlib_files

END_OF_TEXT = "<|endoftext|>"


def stdlib_documents(limit: int) -> list[str]:
    """Standard-library source files in documents of about 2 KB (``data/stdlib.py``: enough of
    them for a held-out split chosen by document), until ``limit`` characters."""
    documents, size = [], 0
    for path in stdlib_files():
        if size >= limit:
            break
        with path.open(encoding="utf-8", errors="replace") as file:
            documents += stdlib.documents(file)
        size = sum(map(len, documents))
    return documents


def write_corpus(folder: Path, limit: int, vocab: int) -> tuple[Path, Path]:
    """(tokenizer folder, data.jsonl) in ``folder``: the documents, and a BPE of ``vocab``
    tokens (``END_OF_TEXT`` the end of each sequence) trained on them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    documents = stdlib_documents(limit)
    data = folder / "data.jsonl"
    with data.open("w") as file:
        file.writelines(json.dumps({"text": document}) + "\n" for document in documents)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[END_OF_TEXT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(documents, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END_OF_TEXT)
    wrapped.save_pretrained(folder / "tokenizer")
    return folder / "tokenizer", data
