"""A small local Hugging Face model and byte-level BPE tokenizer shaped like the real ones: what the pretrained
step (and the tests of init_from=hf: and eval --hf=) load."""

from pathlib import Path

import torch

from data.embedded import documents as embedded_documents
from data.prepare import prepare


def train_byte_bpe_tokenizer(text: str, path: Path) -> int:
    """A byte-level BPE tokenizer.json with GPT-2's end-of-text token, trained on text; returns its vocabulary
    size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(path))
    return tokenizer.get_vocab_size()


def build_tiny_hf_model(root: Path, documents: int = 60) -> tuple[Path, Path]:
    """A small random Qwen3 (grouped-query attention, qk-norm) saved with save_pretrained beside a byte-level BPE
    tokenizer trained on the embedded corpus, and that corpus prepared with it: (model folder, data folder)."""
    import transformers  # heavy: loaded by the steps that build the model only

    transformers.utils.logging.disable_progress_bar()
    root.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join(embedded_documents(documents, seed=0))
    (root / "corpus.txt").write_text(text)
    folder = root / "tiny-qwen3"
    folder.mkdir(exist_ok=True)
    vocab = train_byte_bpe_tokenizer(text, folder / "tokenizer.json")
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=vocab,
                                      max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    data_dir = root / "corpus_tok"
    prepare(str(root / "corpus.txt"), tokenizer=str(folder), out_dir=str(data_dir), val_fraction=0.2, num_proc=1,
            quiet=True)
    return folder, data_dir
