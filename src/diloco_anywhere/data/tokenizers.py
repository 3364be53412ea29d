"""The tokenizers a corpus is prepared with, and what identifies one.

- ``bytes``: one token per UTF-8 byte and a newline after each document, the built-in GPT's
  (``tasks/gpt.py``: vocabulary 256, nothing to ship or agree on);
- anything else: a Hugging Face tokenizer, a Hub id or a local folder
  (``AutoTokenizer.from_pretrained``), whose end-of-sequence token ends each document.

A prepared corpus records its tokenizer's identity (``TokenizerIdentity``): its name, the
SHA-256 of its whole serialized form (vocabulary, merges, normalizer, added tokens), its
vocabulary and end-of-document token, so that a run can refuse shards made with another one.
Encoding a batch uses the fast tokenizer's own threads (Rust, all cores, the GIL released).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field

from diloco_anywhere.bucket.format.framing import Count
from diloco_anywhere.bucket.format.record import Record

BYTES = "bytes"
DtypeName = Literal["uint8", "uint16", "uint32"]


class TokenizerIdentity(Record):
    name: str = Field(min_length=1, max_length=512)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    vocab: Count
    end_of_document: Count  # the token after every document


def dtype_for(vocab: int) -> DtypeName:
    """The narrowest unsigned integer that holds every token id below ``vocab``."""
    for name, bits in (("uint8", 8), ("uint16", 16), ("uint32", 32)):
        if vocab <= 1 << bits:
            return name  # type: ignore[return-value]
    raise ValueError(f"a vocabulary of {vocab} tokens does not fit 32 bits")


@dataclass(frozen=True)
class ByteTokenizer:
    identity = TokenizerIdentity(
        name=BYTES, sha256=hashlib.sha256(b"utf-8 bytes, newline-ended").hexdigest(),
        vocab=256, end_of_document=ord("\n"),
    )  # fmt: skip

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]


class HfTokenizer:
    """A fast Hugging Face tokenizer, its special tokens not added (documents are joined with
    its end-of-sequence token instead)."""

    def __init__(self, name: str, loaded: Any = None) -> None:
        """``name``'s tokenizer, or ``loaded``, one already loaded from ``name``."""
        wrapped = loaded if loaded is not None else _load(name)
        if wrapped.eos_token_id is None:
            raise ValueError(
                f"tokenizer {name}: no end-of-sequence token (documents are ended with it): "
                f"give one that has it, or set its eos_token"
            )
        self._backend: Any = wrapped.backend_tokenizer
        serialized = self._backend.to_str().encode()
        self.identity = TokenizerIdentity(
            name=name, sha256=hashlib.sha256(serialized).hexdigest(), vocab=len(wrapped),
            end_of_document=wrapped.eos_token_id,
        )  # fmt: skip

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        return [
            np.asarray(encoding.ids, dtype=np.uint32)
            for encoding in encode(texts, add_special_tokens=False)
        ]


def _load(name: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except OSError as exc:  # no such folder or Hub id, or no network to reach it
        raise ValueError(f"tokenizer {name}: cannot load it ({exc})") from None


def load_tokenizer(name: str) -> ByteTokenizer | HfTokenizer:
    return ByteTokenizer() if name == BYTES else HfTokenizer(name)
