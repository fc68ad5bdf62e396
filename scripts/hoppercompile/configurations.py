"""The configurations the report compiles in: each one an op's forward and backward run on stand-in CUDA tensors
with the settings (constexprs) a variant launches it with, its launches recorded."""

import torch

from attention.edges import FixedBlock, SlidingWindow
from attention.ops.moba import op as moba_op
from attention.ops.span import op as span_op
from attention.ops.span.spans import band_spans, static_spans
from attention.stochastic import PermutedWindow
from scripts.hoppercompile.options import HopperConfig
from scripts.hoppercompile.recording import Launch, kernel_modules, kernels_of, recording
from scripts.hoppercompile.standins import CUDA, CudaAsMeta

# (sigmoid, ALiBi slopes, a second order of the rows, packed documents) per configuration of span attention, and the
# variants that launch it: the constexprs that change a span kernel's code
SPAN_CONFIGURATIONS = {
    "span softmax": (False, False, False, False),  # swa, mswa, blocks, the bridges; MoBA's own blocks
    "span softmax, ALiBi": (False, True, False, False),  # swat_softmax
    # sa: the band over permuted rows (read in slots), causal in the tokens' order
    "span softmax, order": (False, False, True, False),
    "span sigmoid": (True, False, False, False),  # swat with swat_slopes=none
    "span sigmoid, ALiBi": (True, True, False, False),  # swat
    # document_mask: spans cut to the documents, and a backward that stops at them; sa compares documents instead
    "span softmax, docs": (False, False, False, True),
    "span sigmoid, ALiBi, docs": (True, True, False, True),
    "span softmax, order, docs": (False, False, True, True),
}
PAIR_CONFIGURATION = "span softmax, two paths summed"  # bridge, pbb, se_bridge (branch fusion): Kernel.run_sum
APART_CONFIGURATION = "span softmax, two paths apart"  # sa_swa: sa in slots, then swa adding into its gradients
MOBA_CONFIGURATIONS = {"moba": False, "moba docs": True}  # packed documents or not
WINDOW = 256  # the span configurations' windows: a window reaches the kernels only as lo and hi tensors


def record_launches(c: HopperConfig) -> list[Launch]:
    """The launches of every configuration's forward and backward, on stand-in CUDA tensors. MoBA's forward caches
    its plan (static_spans) under the device "cuda:0", holding stand-ins: call it in a process of its own, as
    main does."""
    B, H, n, D = c.batch, c.heads, c.length, c.head_dim
    H_kv, dtype = c.kv_heads or c.heads, getattr(torch, c.dtype)
    launches, configuration = [], [""]
    with recording(launches, configuration), CudaAsMeta():
        # laid out as the layers pass them: heads-first views of (B, n, H, D) projections
        q = torch.empty(B, n, H, D, dtype=dtype, device=CUDA).transpose(1, 2)
        k, v = (torch.empty(B, n, H_kv, D, dtype=dtype, device=CUDA).transpose(1, 2) for _ in range(2))
        for name, (sigmoid, alibi, ordered, documents) in SPAN_CONFIGURATIONS.items():
            configuration[0] = name
            halo = -1
            if ordered:  # sa in slots, as its layer runs it: the layout's rows read at their tokens
                rule = PermutedWindow(torch.randperm(n), WINDOW)
                halo = rule.halo
                spans = band_spans(rule, n + 2 * halo, CUDA)
            else:
                spans = static_spans(SlidingWindow(WINDOW), n, 1, 0, "cpu").to(CUDA)
            slopes = torch.empty(H, dtype=torch.float32, device=CUDA) if alibi else None  # float32 in any model
            docs = torch.empty(B, n, dtype=torch.long, device=CUDA) if documents else None
            lo, hi, docs, doc_end = span_op.document_spans(spans, docs)
            out, lse = span_op.triton_forward(q, k, v, lo, hi, spans.order, slopes, 0.0, sigmoid, docs, halo)
            span_op.triton_backward(torch.empty_like(out), q, k, v, out, lse, lo, hi, spans.key_first,
                                    spans.key_end, spans.order, slopes, 0.0, sigmoid, docs=docs, doc_end=doc_end,
                                    halo=halo)
        # the bridges' branch fusion: two paths summed, the second pass adding the first's output and gradients
        configuration[0] = PAIR_CONFIGURATION
        a, b = (static_spans(rule, n, 1, 0, "cpu").to(CUDA) for rule in (FixedBlock(WINDOW), SlidingWindow(WINDOW)))
        out, out_a, lse_a, lse_b = span_op.triton_pair_forward(q, k, v, a.lo, a.hi, b.lo, b.hi, None, None)
        span_op.triton_pair_backward(torch.empty_like(out), None, q, k, v, out, out_a, lse_a, lse_b, a.lo, a.hi,
                                     a.key_first, a.key_end, None, None, b.lo, b.hi, b.key_first, b.key_end, None,
                                     None)
        # sa_swa's two paths apart: sa in slots, then swa, whose backward adds its gradients into sa's
        configuration[0] = APART_CONFIGURATION
        rule = PermutedWindow(torch.randperm(n), WINDOW)
        sa = band_spans(rule, n + 2 * rule.halo, CUDA)
        out, out_a, lse_a, lse_b = span_op.triton_pair_forward(q, k, v, sa.lo, sa.hi, b.lo, b.hi, None, None, sa.order,
                                                               rule.halo, summed=False)
        span_op.triton_pair_backward(torch.empty_like(out), torch.empty_like(out_a), q, k, v, out, out_a, lse_a,
                                     lse_b, sa.lo, sa.hi, sa.key_first, sa.key_end, sa.order, None, b.lo, b.hi,
                                     b.key_first, b.key_end, None, None, rule.halo, summed=False)
        k, v = (torch.empty(B, n, H, D, dtype=dtype, device=CUDA).transpose(1, 2) for _ in range(2))
        for name, documents in MOBA_CONFIGURATIONS.items():
            configuration[0] = name
            docs = torch.empty(B, n, dtype=torch.long, device=CUDA) if documents else None
            chosen = moba_op.triton_choose(q, k, c.moba_block, c.moba_topk, docs)
            own = moba_op.own_blocks(c.moba_block, n, "cpu").to(CUDA)
            out, lse = moba_op.triton_forward(q, k, v, chosen, own, c.moba_block, docs)
            moba_op.triton_backward(torch.empty_like(out), q, k, v, out, lse, chosen, own, c.moba_block, docs)
    launched = {launch.kernel.fn.__name__ for launch in launches}
    never = [name for module in kernel_modules() for name in kernels_of(module) if name not in launched]
    if never:
        raise RuntimeError(f"kernels no configuration launches: {', '.join(never)} (add their op to "
                           "scripts/hoppercompile/configurations.py: record_launches)")
    return launches
