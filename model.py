"""The GPT model: token (and position) embeddings, a stack of blocks, a language-model head.

Two architecture families share one block, x = x + mixer(norm(x)); x = x + mlp(norm(x)):
  gpt2   LayerNorm, GELU MLP (4x), learned absolute positions, optional biases, tied embeddings
  llama  RMSNorm, SwiGLU MLP, RoPE (applied inside the mixer), no biases (Transformer++)
Each layer's token mixer comes from the `attention` registry through `attn_pattern`; this file never looks
at a mixer's name.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from attention import build_mixer, simulate_cuda
from attention.call import MixerCall
from attention.documents import document_starts
from attention.kernels import bind_documents
from attention.capabilities import set_window
from config import ModelConfig


def make_norm(config: ModelConfig) -> nn.Module:
    if config.arch == "llama":
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class MLP(nn.Module):
    """GELU MLP (gpt2) or SwiGLU (llama): c_proj(act(c_fc(x)) [* c_gate(x)])."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden = config.resolved_mlp_hidden
        self.swiglu = config.arch == "llama"
        self.gelu = "tanh" if config.gelu == "tanh" else "none"
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.c_gate = nn.Linear(config.n_embd, hidden, bias=config.bias) if self.swiglu else None
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        if self.swiglu:
            h = F.silu(self.c_gate(x)) * self.c_fc(x)
        else:
            h = F.gelu(self.c_fc(x), approximate=self.gelu)
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.mixer = build_mixer(config, layer_idx)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x, pos, cache=None, plan=None, docs=None, shard=None):
        x = x + self.mixer(self.ln_1(x), MixerCall(pos, cache, plan, docs, shard))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        assert config.vocab_size > 0, "vocab_size must be resolved (from the data's meta.json) before building"
        if config.document_mask and not 0 <= config.eot_id < config.vocab_size:
            raise ValueError(f"document_mask=True needs the end-of-text token: eot_id={config.eot_id} is not a token "
                             f"of the vocabulary (0..{config.vocab_size - 1}); set --eot_id (train.py takes the data's)")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        learned = config.resolved_pos_embedding == "learned"
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if learned else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        if config.document_mask:
            for block in self.blocks:
                if not block.mixer.takes_documents:
                    raise ValueError(f"document_mask=True: {type(block.mixer).__name__} does not declare "
                                     "takes_documents, so it cannot stop at a document's end: honour call.docs in its "
                                     "forward and declare takes_documents = True (docs/documents.md), or train "
                                     "without document_mask")
        self.ln_f = make_norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        if self.wte.weight.device.type != "meta":
            self.init_weights()

    def init_weights(self):
        """GPT-2 initialisation: N(0, init_std), residual output projections scaled by 1/sqrt(2 n_layer)."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                scale = 1 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj.weight") else 1.0
                nn.init.normal_(p, mean=0.0, std=std * scale)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        for block in self.blocks:
            block.mixer.init_weights()

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # tied weights are counted once
        if exclude_embeddings:
            n -= self.wte.weight.numel() + (self.wpe.weight.numel() if self.wpe is not None else 0)
        return n

    def forward(self, idx, targets=None, caches=None, start_pos: int = 0, loss_chunk: int = 0, shard=None):
        """Logits (B, T, vocab) and, given targets, the mean cross-entropy (targets < 0 are ignored).

        With caches (one per layer, from init_caches) the call continues a sequence whose first start_pos
        tokens the caches already hold. loss_chunk > 0 computes the head and the loss loss_chunk tokens at a
        time without keeping their logits (returned as None): see chunked_cross_entropy. With document_mask, each
        end-of-text token of idx begins a document that nothing before it reaches (attention/documents.py).
        With shard (context parallelism): see forward_shard.
        """
        if shard is not None:
            return self.forward_shard(idx, targets, shard, loss_chunk)
        B, T = idx.shape
        if start_pos and caches is None:
            raise ValueError("start_pos continues a sequence held in caches; without caches a sequence starts at 0")
        pos = torch.arange(start_pos, start_pos + T, device=idx.device)
        if self.wpe is not None and start_pos + T > self.config.block_size:
            raise ValueError(f"sequence of length {start_pos + T} exceeds block_size {self.config.block_size} "
                             "(learned positions cannot extrapolate)")
        x = self.embed(idx, pos)
        docs = self.documents(idx, pos, caches)
        # each batch's documents bound into the plans once, not at every layer (FlexAttention's narrowed masks)
        plans = bind_documents(self.plan(B, T, idx.device), docs) if caches is None else [None] * len(self.blocks)
        for i, (block, plan) in enumerate(zip(self.blocks, plans)):
            x = block(x, pos, None if caches is None else caches[i], plan, docs)
        if loss_chunk and targets is not None:
            x = self.ln_f(x)
            count = (targets != -1).sum().clamp(min=1)
            loss = chunked_cross_entropy(x, self.lm_head.weight, targets, loss_chunk) / count
            return None, loss.to(torch.promote_types(x.dtype, torch.float32))
        return self.head(x, targets)

    def forward_shard(self, idx, targets, shard, loss_chunk: int = 0):
        """Context parallelism: this process's shard of the sequences idx (B, n), the whole of them on every process
        of the shard's group (token ids are cheap; each layer exchanges what its rule reaches, attention/ops/
        shard.py). Returns the shard's logits (B, n / P, vocab), or None with loss_chunk, and, given targets (B, n),
        the loss of the whole sequences, equal on every process of the group, whose gradient is this shard's part
        of it: the processes' gradients summed are the gradient of the loss."""
        B, n = idx.shape
        if n != shard.n:
            raise ValueError(f"the shard cuts sequences of {shard.n} tokens; these have {n}")
        s, e = shard.bounds()
        every = torch.arange(n, device=idx.device)
        docs = self.documents(idx, every)
        shard = shard.with_docs(docs)
        pos = every[s:e]
        if self.wpe is not None and n > self.config.block_size:
            raise ValueError(f"sequence of length {n} exceeds block_size {self.config.block_size} "
                             "(learned positions cannot extrapolate)")
        x = self.embed(idx[:, s:e], pos)
        for block in self.blocks:
            x = block(x, pos, None, None, None if docs is None else docs[:, s:e], shard)
        if targets is None:
            return self.head(x)
        count = (targets != -1).sum().clamp(min=1)  # the whole sequences' targets, as one process counts them
        x = self.ln_f(x)
        if loss_chunk:
            logits, nll = None, chunked_cross_entropy(x, self.lm_head.weight, targets[:, s:e], loss_chunk)
        else:
            logits = self.lm_head(x)
            nll = token_nll(logits, targets[:, s:e])
        dtype = torch.promote_types(x.dtype, torch.float32)
        whole = nll.detach().clone()  # the sum over the group in float64, as one process sums its tokens
        torch.distributed.all_reduce(whole, group=shard.group)
        part = (nll / count).to(dtype)
        return logits, part + ((whole / count).to(dtype) - part).detach()

    def context_parallel_problems(self) -> list[str]:
        """Why some layers cannot run a shard of a sequence (context parallelism); none: empty."""
        return list(dict.fromkeys(p for block in self.blocks if (p := block.mixer.context_parallel_problem())))

    def documents(self, idx, pos, caches=None):
        """Where each token's document begins (B, T), or None without document_mask; a cached call continues the
        document its caches ended in (Caches.document)."""
        if not self.config.document_mask:
            return None
        first = None if caches is None or getattr(caches, "document", None) is None else caches.document
        docs = document_starts(idx, self.config.eot_id, pos, first)
        if caches is not None:
            caches.document = docs[:, -1]
        return docs

    def embed(self, idx, pos):
        """Token (and learned position) embeddings of idx at positions pos: the blocks' input."""
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(pos)
        return self.drop(x)

    def head(self, x, targets=None):
        """The final norm, the LM head and, given targets, the mean cross-entropy (targets < 0 are ignored)."""
        x = self.ln_f(x)
        logits = self.lm_head(x)
        if targets is None:
            return logits, None
        # mean over the counted targets; 0 (not NaN) when a batch has none, e.g. answer-only training (loss_after)
        count = (targets != -1).sum().clamp(min=1)
        return logits, (token_nll(logits, targets) / count).to(torch.promote_types(x.dtype, torch.float32))

    @torch.compiler.disable  # compiled code would rebuild every mask in its graph (one graph break, if compiled)
    def plan(self, batch_size: int, seq_len: int, device) -> list:
        """Every layer's Mixer.plan for a forward over (batch_size, seq_len) tokens: masks, tiles and sa's
        permutations, built here, outside the blocks (train.py compiles each block on its own)."""
        return [block.mixer.plan(batch_size, seq_len, device) for block in self.blocks]

    def compile_problems(self, seq_len: int, device, dtype) -> list[str]:
        """Why some layers should not be torch.compiled for this length, device and dtype (none: empty)."""
        return list(dict.fromkeys(p for block in self.blocks if (p := block.mixer.compile_problem(seq_len, device, dtype))))

    def set_window(self, window: int) -> int:
        """Give every sliding-window layer a window of `window` positions; returns how many layers took it."""
        return sum(set_window(block.mixer, window) for block in self.blocks)

    def init_caches(self, batch_size: int, max_len: int):
        p = self.wte.weight
        return Caches(block.mixer.init_cache(batch_size, max_len, p.device, p.dtype) for block in self.blocks)

    def generation_bytes(self, batch_size: int, length: int, use_cache: bool = True) -> int:
        """The memory generate() holds at the end of `batch_size` sequences of `length` tokens: the token ids and,
        with caches, every layer's (built on the meta device: their sizes, nothing allocated)."""
        total = batch_size * length * 8  # int64 ids
        if use_cache and all(block.mixer.supports_cache for block in self.blocks):
            cache_len = min(length, self.config.block_size) if self.wpe is not None else length
            dtype = self.wte.weight.dtype
            caches = [block.mixer.init_cache(batch_size, cache_len, "meta", dtype) for block in self.blocks]
            total += sum(t.numel() * t.element_size() for t in _tensors(caches))
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per parameter (forward + backward) plus 3x each mixer's mixing FLOPs."""
        n_matmul = self.num_params(exclude_embeddings=True)  # an untied lm_head is already among them
        if self.lm_head.weight is self.wte.weight:  # tied: the head's matmul uses the excluded embedding
            n_matmul += self.lm_head.weight.numel()
        return 6 * n_matmul + 3 * sum(block.mixer.mixing_flops(seq_len) for block in self.blocks)

    def configure_optimizer(self, weight_decay, learning_rate, betas, device_type):
        """AdamW with weight decay on matrices only (not on biases, norms or other vectors)."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        fused = simulate_cuda.gpu_path(device_type)  # CUDA's fused AdamW (also on the CPU standing in for CUDA)
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, generator=None,
                 use_cache=True):
        """Continue idx (B, T) by max_new_tokens sampled tokens.

        temperature 0 is greedy decoding. With use_cache the prompt is run once and each new token costs one
        step through the layers' caches; without it (or when a mixer has none, as sa) every step re-runs the
        (cropped) context, as nanoGPT does.
        """
        limit = self.config.block_size if self.wpe is not None else None  # learned positions cannot extrapolate
        use_cache = use_cache and all(block.mixer.supports_cache for block in self.blocks)
        caches, cached = None, 0
        for _ in range(max_new_tokens):
            if limit is not None and idx.size(1) > limit:
                context, caches = idx[:, -limit:], None  # window slid past the position table: restart
            else:
                context = idx
            if not use_cache:
                logits, _ = self(context)
            elif caches is None:
                remaining = max_new_tokens if limit is None else limit
                # caches grow as they fill (attention/cache.py): a long generation allocates as it goes
                caches = self.init_caches(idx.size(0), min(context.size(1) + min(remaining, 4096), limit or 1 << 62))
                logits, _ = self(context, caches=caches)
                cached = context.size(1)
            else:
                logits, _ = self(context[:, cached:], caches=caches, start_pos=cached)
                cached = context.size(1)
            idx_next = sample_next(logits[:, -1, :], temperature, top_k, top_p, generator)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


class Caches(list):
    """Every layer's generation state, in order, and (with document_mask) the document each row's last token is
    in: `document`, (B,) positions, None before the first call."""

    document = None


def _tensors(value):
    """Every tensor held in value: nested lists, tuples, dicts and objects' attributes (the layers' caches)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif hasattr(value, "__dict__"):
        yield from _tensors(vars(value))


def token_nll(logits, targets):
    """Summed cross-entropy of logits (..., vocab) against targets (...); targets -1 are ignored. Each token's
    loss is computed in float32 or better and the sum is taken in float64, so the total does not depend on how
    the tokens are grouped (chunked_cross_entropy equals the plain loss)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    nll = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=-1, reduction="none")
    return nll.double().sum()


def _chunk_nll(x, weight, targets):
    return token_nll(F.linear(x, weight), targets)


def chunked_cross_entropy(x, weight, targets, chunk: int):
    """token_nll(x @ weight.T, targets) computed `chunk` tokens at a time, each chunk under activation
    checkpointing: neither the logits nor their float32 copy ever exist for the whole batch (at 16K tokens x
    50K vocabulary that copy alone is 3.3 GB per sequence); backward recomputes one chunk's logits at a time.
    Equal to the plain loss up to summation order."""
    x, targets = x.flatten(0, -2), targets.flatten()
    # split, not slicing: its backward concatenates the chunks' gradients once instead of zero-filling a
    # full-size gradient per chunk
    pieces = zip(x.split(chunk), targets.split(chunk))
    return sum(checkpoint(_chunk_nll, x_c, weight, t_c, use_reentrant=False) for x_c, t_c in pieces)


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """Draw one token per row from last-position logits with temperature, top-k and nucleus (top-p) filtering."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)
