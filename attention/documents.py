"""Packed documents: where each token's document begins, found from the input tokens (ModelConfig.document_mask).

Training windows are cut from documents packed into one stream with the tokenizer's end-of-text token between
them. With document_mask every end-of-text token begins a new document: it and the tokens after it, up to the
next end-of-text token, are one document (the end-of-text token is the next document's first token, as GPT-2
uses it to start unconditional text), and the window's first token begins one too. No attention edge and no
recurrent state crosses from one document into the next; positions stay the window's (RoPE, ALiBi and learned
positions are unchanged, as in torchtitan).

A batch's documents are one tensor, `docs` (B, T) of int64: for each token, the absolute position of its
document's first token. Positions are non-decreasing along a row, so two tokens of a row are in the same document
exactly when their `docs` are equal; for k <= q that is k >= docs[q]. Mixers receive it as forward(..., docs=)
(None: no document mask) and kernels as run(..., docs=): one definition, built on the device without a host
synchronisation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_starts(idx: torch.Tensor, eot_id: int, pos: torch.Tensor, first=None) -> torch.Tensor:
    """docs (B, T) for tokens idx (B, T) at positions pos (T,): the position of the latest end-of-text token at or
    before each token, else `first` (the start of the document the sequence continues: a (B,) tensor or an int;
    None: pos[0], the sequence's first token begins a document)."""
    begin = pos[:1].expand(idx.shape[0]) if first is None else torch.as_tensor(first, device=idx.device)
    begin = begin.expand(idx.shape[0]).to(torch.long)
    marks = torch.where(idx == eot_id, pos.to(torch.long), begin[:, None])
    return marks.cummax(dim=1).values


def same_document(docs: torch.Tensor, q_index, k_index) -> torch.Tensor:
    """Whether the tokens at indices q_index and k_index (into docs' second axis; broadcastable integer tensors)
    of each row are in one document: (B, *broadcast shape)."""
    rows = docs.shape[0]
    d_q = docs.index_select(1, q_index.reshape(-1)).view(rows, *q_index.shape)
    d_k = docs.index_select(1, k_index.reshape(-1)).view(rows, *k_index.shape)
    return d_q == d_k


def document_mask(docs: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) same-document mask of a whole sequence, for the dense reference (O(n^2): tests, small n)."""
    return (docs[:, :, None] == docs[:, None, :])[:, None]


def begins_document(docs: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the tokens that begin a document (where recurrent state starts again from zero)."""
    return docs == pos.to(docs.dtype)[None, :]


def keys_in_document(docs: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """(B, 1, Tq, Tk) bool for cached decoding: the cached keys at key_pos (Tk,) (-1: empty) that lie in the
    document of each query (docs (B, Tq) of the new tokens; a cache holds only earlier positions)."""
    return (key_pos[None, None, :] >= docs[:, :, None])[:, None]


def packed_document_starts(batch: int, n: int, lengths=(200, 3000), seed: int = 0, device="cpu") -> torch.Tensor:
    """docs (batch, n) of documents of random lengths in [lengths[0], lengths[1]] (seeded), as GPT.forward finds
    them: the benchmarks' packed documents."""
    g = torch.Generator().manual_seed(seed)
    marks = torch.zeros(batch, n, dtype=torch.long)
    for row in range(batch):
        i = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        while i < n:
            marks[row, i] = 1
            i += int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
    return document_starts(marks, 1, torch.arange(n)).to(device)


def document_cumsum(x, starts):
    """Cumulative sums of x (..., L) along its last axis that start again at each start (starts, broadcastable
    to x, True where a document begins): bit for bit x.cumsum(-1) before the first start. Their gradient is
    that of the same sums as a masked product, through which no document reaches another's x (the cumsum's
    would return cancelling terms to earlier documents, which rounding leaves nonzero)."""
    sums = x.cumsum(-1)
    latest = torch.arange(x.shape[-1], device=x.device).where(starts, -1).cummax(-1).values  # -1: no start yet
    restarted = sums - F.pad(sums, (1, 0)).gather(-1, latest.clamp(min=0).expand_as(sums))  # less the sum before it
    runs = starts.cumsum(-1)  # equal within one document
    tril = torch.ones(x.shape[-1], x.shape[-1], dtype=torch.bool, device=x.device).tril()
    masked = (((runs[..., :, None] == runs[..., None, :]) & tril).to(x.dtype) @ x.unsqueeze(-1)).squeeze(-1)
    return restarted.detach() + (masked - masked.detach())
