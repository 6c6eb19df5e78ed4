"""Tokenizers: byte-level (no training, 256 bytes + specials) and a trainable byte-level BPE.

Both save themselves into the run directory (`tokenizer.json`) so that generation decodes with the
vocabulary the model was trained on; `load_tokenizer(run_dir)` reads either back.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Protocol

TOKENIZER_FILE = "tokenizer.json"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def save(self, run_dir) -> Path: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; <pad>, <bos>, <eos> follow. Lossless for any text."""

    kind = "byte"

    def __init__(self):
        self.pad_id, self.bos_id, self.eos_id = 256, 257, 258
        self.vocab_size = 256 + len(SPECIAL_TOKENS)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        # Special ids have no text; a cut-off multi-byte character decodes as U+FFFD.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save(self, run_dir) -> Path:
        path = Path(run_dir) / TOKENIZER_FILE
        path.write_text(json.dumps({"atlas_jax_tokenizer": "byte", "vocab_size": self.vocab_size}))
        return path


class BPETokenizer:
    """Byte-level BPE from HF `tokenizers` (GPT-2 style pre-tokenisation, no unknown tokens)."""

    kind = "bpe"

    def __init__(self, hf_tokenizer):
        self._tok = hf_tokenizer
        self.vocab_size = hf_tokenizer.get_vocab_size()
        self.pad_id, self.bos_id, self.eos_id = (hf_tokenizer.token_to_id(t) for t in SPECIAL_TOKENS)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, run_dir) -> Path:
        path = Path(run_dir) / TOKENIZER_FILE
        self._tok.save(str(path))
        return path


def train_or_byte(kind: str, texts: Iterable[str], vocab_size: int):
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer.train(texts, vocab_size)
    raise ValueError(f"tokenizer: kind {kind!r} is not one of ['byte', 'bpe']")


def load_tokenizer(run_dir):
    """The tokenizer a run saved (`run_dir/tokenizer.json`)."""
    path = Path(run_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer: {path} does not exist (was {run_dir} written by atlas-jax train?)")
    data = json.loads(path.read_text())
    if data.get("atlas_jax_tokenizer") == "byte":
        return ByteTokenizer()
    from tokenizers import Tokenizer as HFTokenizer

    return BPETokenizer(HFTokenizer.from_file(str(path)))
