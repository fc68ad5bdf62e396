"""A run's tokenizer (data/tokenizer.py) as a transformers fast tokenizer that encodes text to the same ids, for
the exports (export.py) and lm-eval's HFLM (eval/lm_eval_adapter.py)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter, bytes_to_unicode

from data.tokenizer import ByteTokenizer, HFTokenizer, TiktokenTokenizer


class HFTokenizerError(ValueError):
    pass


EOT_TEXT = "<|endoftext|>"


def hf_tokenizer(tokenizer):
    """A transformers fast tokenizer that encodes text to the ids the run was trained on (data.tokenizer), with
    BOS = EOS = the run's end-of-text token and nothing added by encoding."""
    if isinstance(tokenizer, ByteTokenizer):
        byte_char = bytes_to_unicode()
        rust = Tokenizer(models.BPE({byte_char[b]: b for b in range(256)}, [], fuse_unk=False))
        rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        rust.decoder = decoders.ByteLevel()
        eot = EOT_TEXT
        rust.add_special_tokens([eot])
    elif isinstance(tokenizer, TiktokenTokenizer):
        rust, eot = tiktoken_to_rust(tokenizer.backend)
    elif isinstance(tokenizer, HFTokenizer):
        rust = Tokenizer.from_str(tokenizer.backend.to_str())
        rust.post_processor = None  # the run's text was encoded with add_special_tokens=False
        eot = rust.id_to_token(tokenizer.eot_id)
    else:
        raise HFTokenizerError(f"no Hugging Face form for the tokenizer {tokenizer.name!r} ({type(tokenizer).__name__})")
    if rust.token_to_id(eot) != tokenizer.eot_id:
        raise HFTokenizerError(f"the converted tokenizer's {eot} is id {rust.token_to_id(eot)}, the run's {tokenizer.eot_id}")
    return PreTrainedTokenizerFast(tokenizer_object=rust, bos_token=eot, eos_token=eot, unk_token=None,
                                   name_or_path=tokenizer.name, clean_up_tokenization_spaces=False)


def tiktoken_to_rust(encoding):
    """A tiktoken encoding as byte-level BPE: the vocabulary and merges follow from its ranks (transformers'
    TikTokenConverter), its pattern splits words, and its special tokens keep their ids."""
    class FromEncoding(TikTokenConverter):
        def load_tiktoken_bpe(self, _):
            return encoding._mergeable_ranks

    specials = sorted(encoding._special_tokens.items(), key=lambda item: item[1])
    rust = FromEncoding(pattern=encoding._pat_str, extra_special_tokens=[name for name, _ in specials]).converted()
    for name, i in specials:
        if rust.token_to_id(name) != i:
            raise HFTokenizerError(f"the tiktoken encoding's special token {name} (id {i}) does not follow its ranks")
    return rust, encoding.decode([encoding.eot_token])
