"""Log-likelihood of continuations, batched: the scorer behind candidate ranking, retrieval probes and the
lm-evaluation-harness adapter.

Every sequence is scored in one forward pass of context + continuation, right-padded in a batch: every mixer is
causal, so padding never changes earlier positions, except where a layer's edges depend on the sequence's
length (sa draws its permutation over the padded length: a 255-token sequence at w = 256 is full attention
alone but sparse padded to 300). Such models batch only sequences of equal length (`length_batches`), so a
score never depends on batch_size or on its batch-mates. Contexts longer than the model can take are cut from
the left.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def context_limit(model, max_len: int | None = None) -> int | None:
    """Longest input the model takes: max_len if given, else block_size for learned positions (RoPE and
    position-free models have no hard limit)."""
    if max_len:
        return max_len
    return model.config.block_size if model.wpe is not None else None


def length_independent(model) -> bool:
    """Whether padding a sequence leaves its positions' outputs unchanged (a GPT, or eval/hf_model's VariantLM)."""
    mixers = getattr(model, "mixers", None)
    if mixers is None:
        mixers = [block.mixer for block in model.blocks] if hasattr(model, "blocks") else []
    return all(mixer.length_independent for mixer in mixers)


def length_batches(lengths: list[int], batch_size: int, pad: bool) -> list[list[int]]:
    """Batches of indices, longest first: any lengths together when padding is harmless (pad), else only equal
    lengths."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # similar lengths batch together
    if pad:
        return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    batches, run = [], []
    for i in order:
        if run and (lengths[i] != lengths[run[0]] or len(run) == batch_size):
            batches.append(run)
            run = []
        run.append(i)
    return batches + [run] if run else batches


@torch.no_grad()
def continuation_logprobs(model, pairs, batch_size: int = 16, max_len: int | None = None) -> list[dict]:
    """Score each (context_ids, continuation_ids) pair.

    Returns, per pair: logprob (sum of log p(continuation | context)), nll_mean (per continuation token),
    n_tokens, and greedy (whether greedy decoding from the context reproduces the continuation exactly).
    """
    device = next(model.parameters()).device
    limit = context_limit(model, max_len)
    items = []
    for context, continuation in pairs:
        if not continuation:
            raise ValueError("a continuation needs at least one token")
        seq = list(context) + list(continuation)
        if limit is not None and len(seq) > limit + 1:
            if len(continuation) > limit:
                raise ValueError(f"a continuation of {len(continuation)} tokens exceeds the model's limit {limit}")
            seq = seq[-(limit + 1):]
        if len(seq) < 2:
            raise ValueError("context + continuation need at least two tokens (give a context, e.g. end-of-text)")
        items.append((seq[:-1], seq[1:], len(continuation)))
    results: list[dict | None] = [None] * len(items)
    for batch in length_batches([len(item[0]) for item in items], batch_size, length_independent(model)):
        width = max(len(items[i][0]) for i in batch)
        x = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            x[row, :len(items[i][0])] = torch.tensor(items[i][0])
        logits, _ = model(x.to(device))
        logprobs = F.log_softmax(logits.float(), dim=-1)
        for row, i in enumerate(batch):
            inputs, targets, n = items[i]
            positions = torch.arange(len(inputs) - n, len(inputs), device=device)
            target = torch.tensor(targets[-n:], device=device)
            token_logprobs = logprobs[row, positions, target]
            greedy = bool((logits[row, positions].argmax(-1) == target).all())
            total = float(token_logprobs.sum())
            results[i] = {"logprob": total, "nll_mean": -total / n, "n_tokens": n, "greedy": greedy}
    return results


def rank_candidates(model, context, candidates, batch_size: int = 16, max_len: int | None = None) -> dict:
    """Rank K candidate continuations of one context by NLL (sum and per token); index 0 is not special."""
    scores = continuation_logprobs(model, [(context, c) for c in candidates], batch_size, max_len)
    nll_sum = [-s["logprob"] for s in scores]
    nll_mean = [s["nll_mean"] for s in scores]
    return {"nll_sum": nll_sum, "nll_mean": nll_mean,
            "best_sum": min(range(len(scores)), key=nll_sum.__getitem__),
            "best_mean": min(range(len(scores)), key=nll_mean.__getitem__)}
