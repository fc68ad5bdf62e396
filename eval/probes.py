"""Evaluation during training: small perplexity and retrieval probes at several lengths, logged with the
validation loss (train.py calls training_probes at every eval_tasks_interval steps)."""

from __future__ import annotations

import numpy as np
import torch

from data.tokenizer import get_tokenizer
from eval import niah as niah_task
from eval import ppl as ppl_task


@torch.no_grad()
def training_probes(model, tasks: list[str], lengths: list[int], val_tokens: np.ndarray, eot_id: int,
                    tokenizer_name: str, seed: int, device, ppl_max_tokens: int = 50_000,
                    niah_samples: int = 8) -> dict:
    """{"ppl@L": ..., "niah@L": ...} for each requested task and length the model can take."""
    was_training = model.training
    model.eval()
    values = {}
    limit = model.config.block_size if model.wpe is not None else None
    lengths = [L for L in lengths if limit is None or L <= limit]
    if "ppl" in tasks:
        docs = ppl_task.documents(val_tokens, eot_id, ppl_max_tokens)
        for L in lengths:
            values[f"ppl@{L}"] = ppl_task.perplexity(model, docs, L, device=device, progress=False)["ppl"]
    if "niah" in tasks:  # RULER's niah_single_2 over the validation text, scored by ranking (no generation)
        tokenizer = get_tokenizer(tokenizer_name)
        text = np.asarray(val_tokens[:4 * max(lengths, default=0) + 20_000], dtype=np.int64)
        essay = tokenizer.decode(text[text != eot_id])
        result = niah_task.run(model, tokenizer, essay, lengths, [0.0, 0.5, 1.0], ["niah_single_2"], niah_samples,
                               seed, progress=False, gen_tokens=0, generate=False)
        for L in lengths:  # lengths too short for RULER's template are skipped
            accs = [r["acc_rank"] for r in result["rows"] if r["length"] == L and r["n"]]
            if accs:
                values[f"niah@{L}"] = float(np.mean(accs))
    model.train(was_training)
    return values
