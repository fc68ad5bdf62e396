"""MoBA, Mixture of Block Attention (Lu et al. 2025; paper 000's fourth baseline, §4.2).

The keys are split into blocks of `moba_block` (c) positions. Each query scores every earlier block by
q . mean(k over the block) and attends, causally, to the keys of its `moba_topk` (k) best blocks, its own
block always among them: MoBA's reference code gives the query's own block an infinite score before the
top-k, so a query sees at most c * k keys (paper 000 calls c x k the effective window, Fig. 4). Where fewer
than k blocks exist the query takes all of them. The choice is discrete and carries no gradient (as in MoBA);
the scores over the chosen keys are one softmax.

The edge and the choice are defined once, beside MoBA's kernels (attention/ops/moba/naive.py: chosen_block_edges,
moba_choose). Three kernels evaluate them: `dense` masks all n x n scores (the reference, moba_dense in naive.py);
on CUDA training and prompts run attention/ops/moba's Triton kernels (the choice in one kernel, each query's own
block as span attention over fixed blocks, the other chosen blocks as tiles of the queries that chose one block,
merged by log-sum-exp: no host synchronisation, no graph break under torch.compile); everywhere else (the CPU,
decoding over a cache, attention dropout) `moba_blockwise` (attention/ops/moba/blockwise.py) runs
FlashAttention's forward and backward over groups of (queries, key block) in PyTorch: each query's own
block as one batched causal attention within blocks, and every other chosen block with the queries of every
head that chose it, in one batched matmul. O(n c k) scores, each group's only while it is computed; autograd
keeps q, k, v, the output and one log-sum-exp per query (memory and time within 2x of swa at c k keys per
query: docs/benchmarks.md). Generation keeps every key (a full KV cache): a new query may choose any earlier
block.

With packed documents (document_mask) a query chooses among the blocks its document overlaps, each scored by the
mean of the document's keys in it (the block where the document begins may hold keys of the one before), and
attends to its document's keys alone; every kernel takes docs (naive.py).
"""

from __future__ import annotations

import torch

from attention import simulate_cuda
from attention.cache import KVCache
from attention.call import MixerCall
from attention.kernels import span_available
from attention.layer import Attention
from attention.memory import linear_inputs, padded, rope_tables
from attention.ops.moba.blockwise import moba_blockwise
from attention.ops.moba.naive import moba_choose, moba_dense  # the choice and the reference, beside the kernels
from attention.ops.moba.op import moba_attention, own_blocks
from attention.registry import Setting, refuse_whole_context, register

# each query reads the moba_topk key blocks of moba_block positions scoring best against it, its own block among
# them (at most moba_block * moba_topk keys: paper 000's effective window)
MOBA_BLOCK = Setting("moba_block", int, 128, "moba: the key blocks' length")
MOBA_TOPK = Setting("moba_topk", int, 2, "moba: the blocks each query reads, its own among them")


@register("moba")
class MixtureOfBlockAttention(Attention):
    """Each query attends to the moba_topk key blocks (of moba_block positions) that score best against it,
    its own block included."""
    paper = "000 (baseline)"
    summary = "j <= i in the k blocks of c positions scoring best against i by q_i . mean(k), i's own among them"

    settings = Attention.settings + (MOBA_BLOCK, MOBA_TOPK)
    supports_cache = True  # every key kept: a new query may choose any earlier block
    takes_documents = True
    # a shard's queries route over every earlier block: they receive every earlier position's keys (attend)
    context_parallel = True

    @classmethod
    def example_settings(cls, window):
        return {"moba_block": max(8, window // 2), "moba_topk": 2}

    def pretrained_problem(self):
        return ""  # no parameters of its own: the block choice reads the model's own q and k

    def attend_cached(self, q, keys, values, pos, key_pos, docs=None):
        return self.attend_over(q, keys, values, pos, docs=docs)

    @classmethod
    def check_config(cls, config):
        super().check_config(config)
        if config.moba_block < 1 or config.moba_topk < 1:
            raise ValueError(f"moba_block={config.moba_block}, moba_topk={config.moba_topk}: both must be >= 1")
        refuse_whole_context(config, "moba_block", config.moba_block, "one block holds")
        if config.attn_gate:
            raise ValueError("attn_gate is paper 000's gate for its own variants; moba runs without it")

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.block, self.topk = config.moba_block, config.moba_topk
        self.kernel = moba_dense if config.attn_backend == "dense" else moba_blockwise

    def plan(self, batch_size, seq_len, device, start=0):
        """(the own blocks' spans,) where this forward runs the Triton kernels, else (): decided and built here,
        outside compiled code (a compiled block guards on the answer instead of asking the environment at every
        call, and reads the cached spans as an input: built inside the op during a CUDA graph's warm-up, they would
        stay in the graph's memory pool)."""
        return (own_blocks(self.block, seq_len, str(device)),) if self.uses_triton(device) else ()

    def attend(self, q, k, v, call: MixerCall):
        if call.shard is not None:  # context parallelism: the shard's queries over every earlier key, as in decoding
            shard = call.shard
            kv = shard.gather_range(torch.stack([k, v]), lambda r: (0, shard.bounds(r)[1]), 3, "keys and values")
            return self.attend_over(q, kv[0], kv[1], call.pos, self.kernel, None, call.docs)
        if call.cache is not None:
            k, v, _ = call.cache.update(k, v, call.pos)
        return self.attend_over(q, k, v, call.pos, self.kernel, call.plan, call.docs)

    reaches_far = "its routing reads every earlier block"

    def context_parallel_received(self, shard) -> int:
        return shard.start  # every position before the shard

    def attend_over(self, q, keys, values, pos, kernel=None, plan=None, docs=None):
        """Queries at positions pos over the keys at 0 .. len - 1 (a prompt, or decoding over a cache). plan: plan()'s
        answer at this length (None: asked now); docs (B, Tq): where each query's document begins, or None."""
        dropout_p = self.dropout if self.training else 0.0
        if kernel is moba_blockwise and q.shape[2] == keys.shape[2] and dropout_p == 0:
            plan = self.plan(q.shape[0], q.shape[2], q.device) if plan is None else plan
            if plan:  # training and prompts, on CUDA
                return moba_attention(q, keys, values, self.block, self.topk, docs, own=plan[0])
        chosen = moba_choose(q, keys, pos, self.block, self.topk, docs)
        return (kernel or moba_dense)(q, keys, values, pos, chosen, self.block, dropout_p, docs)

    def uses_triton(self, device) -> bool:
        """Whether training and prompts run the Triton kernels (attention/ops/moba): on CUDA (and the CPU standing
        in for it) with Triton installed, with the blockwise kernel configured (not the dense reference)."""
        return self.kernel is moba_blockwise and simulate_cuda.gpu_path(device) and span_available()

    def expected_graph_breaks(self, device, dtype):
        if self.kernel is moba_blockwise and not self.uses_triton(device):
            return "moba's blockwise kernel groups queries by the blocks they chose (data-dependent sizes): it runs eagerly"
        return ""

    def init_cache(self, batch_size, max_len, device, dtype):
        return KVCache((batch_size, self.n_head, max_len, self.head_dim), device, dtype)

    def describe(self):
        return f"moba: blocks of {self.block}, top {self.topk} (own block included), at most {self.block * self.topk} keys"

    def edge_counts(self, seq_len):
        """Scores per head over a sequence: each query's own block up to itself, plus topk - 1 earlier
        blocks where it has them (the blocks differ by query, the number does not)."""
        pos = torch.arange(seq_len)
        own = pos // self.block
        count = int(((pos - own * self.block + 1) + self.block * own.clamp(max=self.topk - 1)).sum())
        return [(count, count)] * self.n_head

    def edge_mask(self, seq_len, device="cpu"):
        """Every causal pair: which blocks a query reads depends on the data, and any earlier one may win."""
        pos = torch.arange(seq_len, device=device)
        return pos[None, :] <= pos[:, None]

    def mixing_flops(self, seq_len):
        block_scores = 2 * self.head_dim * self.n_head * (-(-seq_len // self.block))  # q . every block mean
        return super().mixing_flops(seq_len) + block_scores

    def saved_activations(self, m, k, B: int, T: int):
        """MoBA (attention/moba.py): the blockwise kernel keeps what FlashAttention's backward needs, in float32:
        q (after RoPE; without RoPE a view that keeps all of qkv; a float32 copy under bf16), the keys and values
        padded to whole blocks (float32 copies), the output and one log-sum-exp per query and head, and the
        groups' pair indices (int64: the order, row, head and query of each pair beyond the own block). Each
        group's scores exist only while it is computed or recomputed. The dense backend is the n x n reference:
        no estimate."""
        C, H, D, a, tokens = m.n_embd, m.n_head, m.head_dim, k.act, B * T
        if self.kernel is not moba_blockwise:
            raise ValueError("no memory model for moba's dense reference (n x n scores): use attn_backend=auto")
        f32, width = 4, H * D
        saved = {"c_attn input": tokens * linear_inputs(k, 1, C)}
        if a != f32:
            saved["q (float32 copy)"] = f32 * width * tokens
        elif self.rope_theta is not None:
            saved["q after RoPE"] = a * width * tokens
        else:
            saved["qkv"] = 3 * a * width * tokens
        if self.rope_theta is not None:
            saved["RoPE cos/sin tables"] = rope_tables(T, D)
        saved["k, v padded to whole blocks (float32)"] = 2 * f32 * B * width * padded(T, self.block)
        saved["output and log-sum-exp (float32)"] = f32 * B * H * T * (D + 1)
        saved["pair indices (int64)"] = 4 * 8 * B * H * T * (self.topk - 1)
        saved["merged heads"] = a * C * tokens
        return saved, a * tokens * 5 * C  # c_attn's and c_proj's outputs, the chunks' joined output
