"""Data: tokenizers, the embedded corpus, preparing token memmaps and reading them back."""
