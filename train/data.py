"""Training data: documents -> tokens -> packed rows with segment ids -> a checkpointable loader.

    documents (built-in corpus, .txt / .jsonl / .parquet files, or a pre-tokenised .npy stream)
      -> a held-out split of whole documents (by seed)
      -> token ids (byte or BPE tokenizer trained on the training split; saved in the run directory)
      -> one stream, each document ended by <eos>, cut into rows of seq_len + 1 tokens that overlap
         by one token (every token is a target once); segment ids number the documents in a row
      -> grain: MapDataset -> shuffle(seed) (reshuffled every epoch) -> repeat -> batch(global batch)

A batch is the *global* batch (`tokens`, `targets`, `segment_ids` [B, T] int32 and `mask` [B, T]
float32: 1 where the target lies in the same document as the input). Every process builds the same
global batch and hands its devices their rows (sharding.global_batch_array), so one process and
many see the same data in the same order.
The loader's state is grain's iterator state, a small dict saved with each checkpoint.
"""
from __future__ import annotations

import glob as globlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import ConfigError, DataConfig
from .tokenizer import TOKENIZER_FILE, ByteTokenizer, load_tokenizer, train_or_byte

BUILTIN_CORPUS = Path(__file__).resolve().parent / "data" / "shakespeare.txt"
NPY_PIECES = 20     # a .npy stream without an end-of-document id is cut into this many documents
_EXTENSIONS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "jsonl", ".json": "jsonl",
               ".parquet": "parquet", ".npy": "npy"}


def _data_error(message: str):
    raise ConfigError(f"data.source: {message}")


# --- reading documents --------------------------------------------------------------------------

def resolve_files(source: str) -> list[Path]:
    if source == "builtin":
        return [BUILTIN_CORPUS]
    path = Path(os.path.expanduser(source))
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _EXTENSIONS)
        if not files:
            _data_error(f"directory {source!r} holds no {sorted(_EXTENSIONS)} files")
        return files
    matches = sorted(Path(p) for p in globlib.glob(os.path.expanduser(source), recursive=True))
    files = [p for p in matches if p.is_file()]
    if not files:
        _data_error(f"{source!r} does not exist (give 'builtin', a file, a directory or a glob)")
    return files


def _format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    found = _EXTENSIONS.get(path.suffix.lower())
    if found is None:
        _data_error(f"cannot tell the format of {path} from its extension; set data.format to one of "
                    f"['text', 'jsonl', 'parquet', 'npy']")
    return found


def _read_text(path: Path, cfg: DataConfig) -> list[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    return [doc.strip() for doc in text.split(cfg.text_separator) if doc.strip()]


def _read_jsonl(path: Path, cfg: DataConfig) -> list[str]:
    docs = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                _data_error(f"{path}:{line_no} is not JSON ({err.msg})")
            if not isinstance(record, dict) or cfg.text_field not in record:
                _data_error(f"{path}:{line_no} has no key {cfg.text_field!r} (set data.text_field)")
            if record[cfg.text_field]:
                docs.append(str(record[cfg.text_field]))
    return docs


def _read_parquet(path: Path, cfg: DataConfig) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        _data_error(f"reading {path} needs pyarrow: pip install pyarrow")
    schema = pq.read_schema(path)
    if cfg.text_field not in schema.names:
        _data_error(f"{path} has no column {cfg.text_field!r} (columns: {schema.names}; set data.text_field)")
    column = pq.read_table(path, columns=[cfg.text_field]).column(cfg.text_field).to_pylist()
    return [str(doc) for doc in column if doc]


def _read_npy(path: Path, cfg: DataConfig) -> list[np.ndarray]:
    ids = np.load(path, mmap_mode="r")
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        _data_error(f"{path} must hold a 1-D integer array of token ids, got {ids.dtype} {ids.shape}")
    ids = np.asarray(ids, dtype=np.int32)
    if cfg.npy_eos_id < 0:
        # No document boundaries: equal pieces, so the held-out split can take whole pieces.
        return [piece for piece in np.array_split(ids, NPY_PIECES) if piece.size]
    ends = np.flatnonzero(ids == cfg.npy_eos_id) + 1
    return [doc for doc in np.split(ids, ends) if doc.size]


def read_documents(cfg: DataConfig) -> tuple[list, bool]:
    """(documents, pretokenised): strings, or int32 id arrays for .npy data (never mixed)."""
    files = resolve_files(cfg.source)
    formats = {_format_of(p, cfg.format) for p in files}
    if "npy" in formats and len(formats) > 1:
        _data_error(f"mixes pre-tokenised .npy files with text ({sorted(formats)}); use one kind")
    readers = {"text": _read_text, "jsonl": _read_jsonl, "parquet": _read_parquet, "npy": _read_npy}
    docs = []
    for path in files:
        docs.extend(readers[_format_of(path, cfg.format)](path, cfg))
    if cfg.max_documents:
        docs = docs[: cfg.max_documents]
    if len(docs) < 2:
        _data_error(f"{cfg.source!r} gives {len(docs)} document(s); a held-out split needs at least 2")
    return docs, "npy" in formats


def split_documents(docs: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """Whole documents held out, chosen by seed; at least one on each side. Order kept."""
    order = np.random.default_rng(seed).permutation(len(docs))
    n_eval = min(max(1, round(eval_fraction * len(docs))), len(docs) - 1)
    held = set(order[:n_eval].tolist())
    return ([d for i, d in enumerate(docs) if i not in held], [d for i, d in enumerate(docs) if i in held])


# --- pre-tokenised ids as a "tokenizer" -----------------------------------------------------------

class IdsTokenizer:
    """For .npy data: ids are already tokens; decode shows them as numbers."""

    kind = "ids"

    def __init__(self, vocab_size: int, eos_id: int):
        self.vocab_size, self.eos_id, self.pad_id = vocab_size, eos_id, -1

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    def save(self, run_dir) -> Path:
        path = Path(run_dir) / TOKENIZER_FILE
        path.write_text(json.dumps({"atlas_jax_tokenizer": "ids", "vocab_size": self.vocab_size,
                                    "eos_id": self.eos_id}))
        return path


def get_tokenizer(cfg: DataConfig, train_docs: list, pretokenised: bool, run_dir=None):
    """The run's tokenizer: the one saved in run_dir if there is one (a resumed run decodes and
    encodes exactly as before), else a new one (BPE trained on the training split) saved there."""
    saved = Path(run_dir) / TOKENIZER_FILE if run_dir else None
    if saved is not None and saved.is_file():
        data = json.loads(saved.read_text())
        if data.get("atlas_jax_tokenizer") == "ids":
            return IdsTokenizer(data["vocab_size"], data["eos_id"])
        return load_tokenizer(run_dir)
    if pretokenised:
        if cfg.npy_vocab_size <= 0:
            raise ConfigError("config: data.npy_vocab_size: pre-tokenised .npy data needs its vocabulary size (> 0)")
        tok = IdsTokenizer(cfg.npy_vocab_size, cfg.npy_eos_id)
    else:
        tok = train_or_byte(cfg.tokenizer, train_docs, cfg.vocab_size)
    if saved is not None:
        saved.parent.mkdir(parents=True, exist_ok=True)
        tok.save(run_dir)
    return tok


def encode_documents(docs: list, tokenizer, pretokenised: bool) -> list[np.ndarray]:
    """Each document's ids, <eos>-terminated (a .npy document keeps the <eos> it was split at)."""
    if pretokenised:
        out = [np.asarray(d, np.int32) for d in docs]
        too_big = max(int(d.max()) for d in out)
        if too_big >= tokenizer.vocab_size:
            raise ConfigError(f"config: data.npy_vocab_size: {tokenizer.vocab_size} is too small for token id {too_big}")
        if tokenizer.eos_id >= 0:
            out = [d if d[-1] == tokenizer.eos_id else np.append(d, np.int32(tokenizer.eos_id)) for d in out]
        return out
    if isinstance(tokenizer, ByteTokenizer):
        return [np.append(np.frombuffer(d.encode("utf-8"), np.uint8).astype(np.int32), np.int32(tokenizer.eos_id))
                for d in docs]
    encoded = tokenizer._tok.encode_batch(docs) if hasattr(tokenizer, "_tok") else [tokenizer.encode(d) for d in docs]
    return [np.asarray((e.ids if hasattr(e, "ids") else e) + [tokenizer.eos_id], np.int32) for e in encoded]


# --- packing --------------------------------------------------------------------------------------

def pack_rows(token_docs: list[np.ndarray], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate documents and cut into rows of seq_len + 1 tokens, consecutive rows sharing one
    token. Returns (ids, segment ids) [N, seq_len + 1]; segment ids restart at 1 in each row. The
    tail shorter than a row is dropped (fewer than seq_len tokens of the whole stream)."""
    stream = np.concatenate(token_docs)
    doc_of = np.concatenate([np.full(len(d), i, np.int32) for i, d in enumerate(token_docs)])
    n_rows = (len(stream) - 1) // seq_len
    if n_rows < 1:
        return np.zeros((0, seq_len + 1), np.int32), np.zeros((0, seq_len + 1), np.int32)
    index = np.arange(n_rows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    ids, docs = stream[index], doc_of[index]
    segments = (docs - docs[:, :1] + 1).astype(np.int32)    # documents are consecutive in a row
    return ids.astype(np.int32), segments


def rows_to_example(ids: np.ndarray, segments: np.ndarray) -> dict:
    """A row (or rows) of seq_len + 1 -> model inputs and next-token targets of length seq_len."""
    return {"tokens": ids[..., :-1], "targets": ids[..., 1:], "segment_ids": segments[..., :-1],
            "mask": (segments[..., 1:] == segments[..., :-1]).astype(np.float32)}


class PackedRows:
    """Random-access rows for grain.MapDataset.source."""

    def __init__(self, ids: np.ndarray, segments: np.ndarray):
        self.ids, self.segments = ids, segments

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return rows_to_example(self.ids[index], self.segments[index])


# --- the dataset a run trains on ------------------------------------------------------------------

@dataclass
class Dataset:
    tokenizer: object
    train_rows: PackedRows
    eval_rows: PackedRows
    train_token_counts: np.ndarray     # unigram counts over the training split (for the baseline)
    batch_size: int
    seed: int

    def train_iterator(self):
        """grain iterator over global batches, infinite; get_state()/set_state() checkpoint it."""
        import grain

        ds = (grain.MapDataset.source(self.train_rows).shuffle(seed=self.seed).repeat()
              .batch(self.batch_size, drop_remainder=True))
        return iter(ds.to_iter_dataset())

    def eval_batches(self, n_batches: int) -> list[dict]:
        """The held-out batches, fixed (same rows every evaluation): min(n, available) of them."""
        n = min(n_batches, len(self.eval_rows) // self.batch_size)
        return [rows_to_example(self.eval_rows.ids[i * self.batch_size:(i + 1) * self.batch_size],
                                self.eval_rows.segments[i * self.batch_size:(i + 1) * self.batch_size])
                for i in range(n)]

    def unigram_loss(self, n_batches: int) -> float:
        """Cross-entropy (nats/token) of the training split's add-one unigram on the held-out targets."""
        counts = self.train_token_counts.astype(np.float64) + 1.0
        log_p = np.log(counts / counts.sum())
        total, weight = 0.0, 0.0
        for batch in self.eval_batches(n_batches):
            total -= float((log_p[batch["targets"]] * batch["mask"]).sum())
            weight += float(batch["mask"].sum())
        return total / weight


def build_dataset(cfg: DataConfig, *, seq_len: int, batch_size: int, seed: int, run_dir=None) -> Dataset:
    docs, pretokenised = read_documents(cfg)
    train_docs, eval_docs = split_documents(docs, cfg.eval_fraction, seed)
    tokenizer = get_tokenizer(cfg, train_docs, pretokenised, run_dir)
    train_tokens = encode_documents(train_docs, tokenizer, pretokenised)
    eval_tokens = encode_documents(eval_docs, tokenizer, pretokenised)
    train = PackedRows(*pack_rows(train_tokens, seq_len))
    held = PackedRows(*pack_rows(eval_tokens, seq_len))
    if len(train) < batch_size:
        raise ConfigError(f"config: batch_size: the training split packs into {len(train)} rows of "
                          f"seq_len={seq_len}, fewer than batch_size={batch_size}; use more data or a smaller batch")
    if len(held) < batch_size:
        raise ConfigError(f"config: data.eval_fraction: the held-out split packs into {len(held)} rows of "
                          f"seq_len={seq_len}, fewer than batch_size={batch_size}; raise data.eval_fraction")
    counts = np.bincount(np.concatenate(train_tokens), minlength=tokenizer.vocab_size)
    return Dataset(tokenizer, train, held, counts, batch_size, seed)

