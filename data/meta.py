"""
Reading prepared data: a folder written by data/prepare.py holds

    train.bin, val.bin   raw token ids, dtype from meta.json, documents separated by eot_id
    meta.json            tokenizer, vocab_size, eot_id, dtype, token counts, provenance

load_meta() checks the three agree before anything trains on them, because a
truncated or mismatched bin otherwise trains silently on garbage. Each error
says what is wrong and how to fix it.
"""

import hashlib
import json
import os

import numpy as np

from data.tokenizer import TokenizerUnavailable, get_tokenizer

FORMAT_VERSION = 1
REQUIRED_KEYS = ("format_version", "tokenizer", "vocab_size", "eot_id", "dtype", "train_tokens", "val_tokens")
DTYPES = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}
SPLITS = ("train", "val")


class DataError(Exception):
    """Prepared data is missing or inconsistent, or a dataset cannot be prepared."""


def prepare_command(data_dir, meta=None):
    """The command that (re)creates data_dir, as precisely as meta allows: the original options repeated."""
    meta = meta if isinstance(meta, dict) else {}
    options = [f"--dataset={meta.get('source', '...')}", f"--tokenizer={meta.get('tokenizer', '...')}"]
    if meta.get("max_tokens"):
        options.append(f"--max_tokens={meta['max_tokens']}")
    split = meta.get("split") if isinstance(meta.get("split"), dict) else {}
    if split.get("method") == "enwik8":
        options.append(f"--enwik8_val={split.get('val_is', 'val')}")
    elif "val_fraction" in split and split.get("method") != "source":
        options.append(f"--val_fraction={split['val_fraction']}")
    if split.get("seed"):
        options.append(f"--seed={split['seed']}")
    if meta.get("split_articles"):
        options.append("--split_articles")
    if split.get("method") == "source" and split.get("val_split") == "test":
        options.append("--wikitext_val=test")
    if meta.get("slimpajama_sets"):
        options.append(f"--slimpajama_sets={','.join(meta['slimpajama_sets'])}")
    return "python -m data.prepare " + " ".join(options) + f" --out_dir={data_dir}"


IDENTITY_KEYS = ("tokenizer", "vocab_size", "eot_id", "vocab_sha256")  # data.tokenizer.Tokenizer.identity()


def tokenizer_identity(meta: dict) -> dict:
    """The tokenizer identity recorded in a meta.json or a checkpoint (vocab_sha256 is absent from data prepared,
    and checkpoints trained, before it was recorded)."""
    return {key: meta[key] for key in IDENTITY_KEYS if meta.get(key) is not None}


def tokenizer_mismatch(expected: dict, data_meta: dict, data_dir, what: str = "the checkpoint") -> str:
    """Why tokens of data_dir cannot be read with the tokenizer `expected` (a checkpoint's identity), "" when they
    can. The vocabulary hashes decide where both sides have one (a tokenizer can go by two names); otherwise the
    name, the vocabulary size and the end-of-text id must all agree."""
    found = tokenizer_identity(data_meta)
    if "vocab_sha256" in expected and "vocab_sha256" in found:
        same = expected["vocab_sha256"] == found["vocab_sha256"]
    else:
        same = all(expected[key] == found.get(key) for key in ("tokenizer", "vocab_size", "eot_id") if key in expected)
    if same:
        return ""
    describe = lambda i: f"{i.get('tokenizer')!r} ({i.get('vocab_size', '?')} tokens)"  # noqa: E731
    same_name = found.get("tokenizer") == expected.get("tokenizer")
    return (f"{data_dir} was prepared with the tokenizer {describe(found)}, but {what} uses {describe(expected)}"
            + (" (the same name, another vocabulary)" if same_name else "")
            + f": its numbers would be meaningless; prepare the text with --tokenizer={expected.get('tokenizer')} "
              "(python -m data.prepare --dataset=... --tokenizer=...)")


def check_vocabulary(data_dir, meta) -> dict:
    """meta.json's tokenizer against the tokenizer of that name here (vocab_size, eot_id and, where meta.json
    has one, the vocabulary hash), and the token ids against vocab_size (a meta that does not describe its
    data would crash, or worse train silently, further on). Returns the data's tokenizer identity, which
    checkpoints record: meta.json's, with the hash from the tokenizer where the data predates it."""
    redo = f"re-run {prepare_command(data_dir, meta)}"
    identity = tokenizer_identity(meta)
    try:
        found = get_tokenizer(meta["tokenizer"]).identity()
    except TokenizerUnavailable:
        found = None  # not loadable here (no network): the token ids are still checked below
    if found is not None:
        same_size = (found["vocab_size"], found["eot_id"]) == (meta["vocab_size"], meta["eot_id"])
        if not same_size or meta.get("vocab_sha256", found["vocab_sha256"]) != found["vocab_sha256"]:
            raise DataError(f"{data_dir}/meta.json says vocab_size {meta['vocab_size']} and eot_id {meta['eot_id']}, "
                            f"but its tokenizer {meta['tokenizer']!r} has "
                            + ("another vocabulary of that size here" if same_size else
                               f"{found['vocab_size']} and {found['eot_id']}")
                            + f": the meta does not describe this data; {redo}")
        identity = found
    for split in SPLITS:
        tokens = open_tokens(data_dir, split)
        top = int(np.max(tokens[:50_000_000]))
        if top >= meta["vocab_size"]:
            raise DataError(f"{data_dir}/{split}.bin holds token id {top}, beyond meta.json's vocab_size "
                            f"{meta['vocab_size']}: the bins and the meta do not match; {redo}")
    return identity


def load_meta(data_dir) -> dict:
    """meta.json of a prepared folder, after checking it against train.bin and val.bin."""
    data_dir = str(data_dir)
    if not os.path.isdir(data_dir):
        raise DataError(f"{data_dir} does not exist: prepare it first with {prepare_command(data_dir)}")
    meta_path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(meta_path):
        raise DataError(f"{meta_path} is missing, so {data_dir} is not (completely) prepared: "
                        f"run {prepare_command(data_dir)}")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{meta_path} is not valid JSON ({e}): re-run {prepare_command(data_dir)}") from e
    if not isinstance(meta, dict):
        raise DataError(f"{meta_path} is not a JSON object: re-run {prepare_command(data_dir)}")
    redo = f"re-run {prepare_command(data_dir, meta)}"

    missing = [k for k in REQUIRED_KEYS if k not in meta]
    if missing:
        raise DataError(f"{meta_path} lacks {', '.join(missing)}: it was not written by data/prepare.py "
                        f"or is from an older version; {redo}")
    if meta["format_version"] != FORMAT_VERSION:
        raise DataError(f"{meta_path} has format_version {meta['format_version']}, this code reads "
                        f"{FORMAT_VERSION}; {redo}")
    if meta["dtype"] not in DTYPES:
        raise DataError(f"{meta_path} has unknown dtype {meta['dtype']!r} "
                        f"(expected one of {', '.join(DTYPES)}); {redo}")
    dtype = DTYPES[meta["dtype"]]
    if meta["vocab_size"] - 1 > np.iinfo(dtype).max:
        raise DataError(f"{meta_path} says dtype {meta['dtype']} but vocab_size {meta['vocab_size']}: "
                        f"token ids up to {meta['vocab_size'] - 1} do not fit; {redo}")

    for split in SPLITS:
        path = os.path.join(data_dir, f"{split}.bin")
        if not os.path.exists(path):
            raise DataError(f"{path} is missing: {redo}")
        size = os.path.getsize(path)
        if size % dtype.itemsize:
            raise DataError(f"{path} has {size} bytes, not a multiple of {dtype.itemsize} ({meta['dtype']}): "
                            f"the file is truncated or was written with another dtype; {redo}")
        tokens, expected = size // dtype.itemsize, meta[f"{split}_tokens"]
        if tokens != expected:
            raise DataError(f"{path} holds {tokens} tokens but {meta_path} says {split}_tokens={expected}: "
                            f"the bins and meta.json are from different or interrupted runs; {redo}")
        if tokens == 0:
            raise DataError(f"{path} holds no tokens, so there is nothing to "
                            f"{'train' if split == 'train' else 'evaluate'} on; {redo}")
    return meta


def open_tokens(data_dir, split) -> np.memmap:
    """Read-only memmap of a validated split ("train" or "val")."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    meta = load_meta(data_dir)
    return np.memmap(os.path.join(str(data_dir), f"{split}.bin"), dtype=DTYPES[meta["dtype"]], mode="r")


# what makes prepared data the same data: where it came from, how it was split, and what that gave (not when it was
# written: preparing the same corpus the same way again is the same data)
DATA_IDENTITY = ("source", "split", "train_tokens", "val_tokens", "train_documents", "val_documents", "max_tokens")


def data_identity(meta: dict) -> dict:
    """The fields of a meta.json that identify its data (DATA_IDENTITY)."""
    return {key: meta.get(key) for key in DATA_IDENTITY}


def data_changes(saved: dict, meta: dict) -> list[str]:
    """How the data of meta.json differs from a saved data_identity: one 'field (saved X, now Y)' per field."""
    now = data_identity(meta)
    return [f"{key} ({saved.get(key)!r} saved, {now[key]!r} now)" for key in DATA_IDENTITY
            if key in saved and saved.get(key) != now[key]]


def split_fingerprint(data_dir, split="val", limit: int = 1 << 26) -> str:
    """A short hash of a split's tokens (its size and first `limit` bytes): which text an evaluation read, so
    results on other data are never mistaken for a run's own validation numbers, wherever the folder lies."""
    path = os.path.join(str(data_dir), f"{split}.bin")
    digest = hashlib.sha256(str(os.path.getsize(path)).encode())
    with open(path, "rb") as f:
        digest.update(f.read(limit))
    return digest.hexdigest()[:16]


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy in nats of the token frequencies: the loss of the best model that ignores context."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    chunk = 1 << 24  # bincount copies its input to int64, so count big memmaps a slice at a time
    for start in range(0, len(tokens), chunk):
        counts += np.bincount(np.asarray(tokens[start:start + chunk], dtype=np.int64), minlength=vocab_size)
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())
