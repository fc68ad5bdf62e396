"""The kernel contract: what every attention kernel of attention/ops says and does, so that attention/kernels.py
plans and runs any of them by asking its registry (KERNELS) instead of knowing them by name.

A kernel (a subclass of Kernel, in the module or package of its algorithm beside its reference) answers:

    problem(call)      why it cannot run this call at all ("" when it can): an explicit attn_backend refuses with it
    suits(call)        whether attn_backend=auto should pick it for this call (asked in AUTO_ORDER, first wins)
    replaces           the kernels it takes over from whenever it suits a call (the window kernel: chunked, flex)
    selectable         whether attn_backend may name it
    plan(call)         its typed plan data (built outside compiled code, cached per rule and length where it
                       can be); raising KernelRefused sends auto to the next kernel in its order
    run(q, k, v, plan, dropout_p, docs)    attention of q (B, H, n, D) over k, v (B, H or fewer, n, D); docs
                       (B, n), where each token's document begins (attention/documents.py), for a call planned
                       with documents: the rule's edges AND same document
    document_problem(call)    why it cannot mask documents for this call ("" when it can; the default: it
                       cannot), asked only for calls with documents
    run_in_layout(q, k, v, plan, layout, dropout_p, docs)    the same for a plan over a layout's rows
                       (attention/layouts.py) with q, k, v, docs and the output in token order, the kernel reading
                       each row at its token; None where it cannot (the default: the caller gathers and scatters)
    run_sum(q, k, v, plans, dropout_p, docs)    the sum of several plans' outputs in one call; None where the
                       kernel does not fuse it (the default: the caller adds the outputs)
    run_apart(q, k, v, plans, layouts, dropout_p, docs)    each of several plans' outputs (each plan over its layout
                       or in token order) in one call whose backward sums their gradients in the kernels; None where
                       the kernel does not fuse them (the default: the caller runs each plan)
    scores(plan, n_head)             the scores it computes over all heads (what it costs, against the edges)

Adding a kernel is one package under attention/ops/ and one entry in attention/kernels.py's KERNELS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention import simulate_cuda
from attention.edges import EdgeRule


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """What is to be planned: attention of n queries at positions start.. under rule, over n_head heads of
    head_dim on a device, with an optional score_mod and the score activation ("softmax" or "sigmoid");
    chunk: the chunked kernel's query chunk (0: the rule's own); documents: whether run() gets each batch's
    documents (attention/documents.py) and masks the edges between them."""

    rule: EdgeRule
    n: int
    n_head: int
    head_dim: int
    device: str
    start: int = 0
    score_mod: object = None
    activation: str = "softmax"
    chunk: int = 0
    documents: bool = False

    @property
    def gpu_path(self) -> bool:
        """On CUDA, or on the CPU standing in for it (attention/simulate_cuda.py)."""
        return simulate_cuda.gpu_path(torch.device(self.device))

    @property
    def plain_softmax(self) -> bool:
        return self.score_mod is None and self.activation == "softmax"


@dataclass(eq=False)
class AttentionPlan:
    """A resolved kernel and everything it needs that depends only on the call (the rule, the length, the heads
    and the device): `data` is the kernel's own typed plan (SpanPlan, ChunkedGroups, FlexMasks, WindowTiles,
    SdpaMask, DensePlan).

    Plans are built outside compiled code (Mixer.plan, called by GPT.forward before the blocks run), so a
    compiled block receives its masks as inputs instead of rebuilding them in its graph at every forward, and
    its graph has no data-dependent branch on them (e.g. whether a row has no key is decided here). The
    expensive parts are cached per (rule, length, device): every layer with the same rule shares them."""

    kernel: str
    call: AttentionCall
    data: object = None

    @property
    def rule(self) -> EdgeRule:
        return self.call.rule

    @property
    def n(self) -> int:
        return self.call.n

    @property
    def start(self) -> int:
        return self.call.start

    @property
    def score_mod(self):
        return self.call.score_mod

    @property
    def activation(self) -> str:
        return self.call.activation

    @property
    def documents(self) -> bool:
        return self.call.documents


class KernelRefused(Exception):
    """Raised by Kernel.plan when the call turns out not to fit (found only while planning): attn_backend=auto
    goes on to the next kernel of its order, an explicit attn_backend reports the reason."""


class Kernel:
    """One attention kernel (see the module docstring). The defaults: runs every call, never auto's pick,
    replaces none."""

    name = ""
    replaces: tuple = ()
    selectable = True  # a value of attn_backend (the window kernel is only ever chosen in another's place)

    def problem(self, call: AttentionCall) -> str:
        return ""

    def suits(self, call: AttentionCall) -> bool:
        return False

    def document_problem(self, call: AttentionCall) -> str:
        return f"the {self.name} kernel has no document mask (document_mask=True): use attn_backend=auto"

    def plan(self, call: AttentionCall):
        raise NotImplementedError

    def run(self, q, k, v, plan: AttentionPlan, dropout_p: float = 0.0, docs=None):
        raise NotImplementedError

    def run_in_layout(self, q, k, v, plan: AttentionPlan, layout, dropout_p: float = 0.0, docs=None):
        return None

    def bind_documents(self, plan: AttentionPlan, docs, memo: dict) -> AttentionPlan:
        """The plan bound to one batch's documents (docs (B, n), token order): what the kernel derives from the
        documents alone, built once per forward and shared through memo by the layers' plans, not at each call
        (attention/kernels.py: bind_documents). The default: nothing to derive, the plan as it is."""
        return plan

    def run_sum(self, q, k, v, plans: tuple, dropout_p: float = 0.0, docs=None):
        """The sum of several of this kernel's plans over the same q, k, v in one call, where the kernel fuses it;
        None where it does not (the caller adds the plans' outputs)."""
        return None

    def run_apart(self, q, k, v, plans: tuple, layouts: tuple, dropout_p: float = 0.0, docs=None):
        """Each of several of this kernel's plans' outputs over the same q, k, v, a plan over a layout's rows
        (layouts[i], attention/layouts.py; None: token order) run as run_in_layout runs it, in one call whose
        backward adds the plans' gradients in the kernels, where the kernel fuses it; None where it does not (the
        caller runs each plan, and autograd adds their gradients)."""
        return None

    def scores(self, plan: AttentionPlan, n_head: int) -> int:
        raise NotImplementedError


def full_problem(kernel: Kernel, call: AttentionCall) -> str:
    """Why a kernel cannot run a call: its problem(), then, for a call with documents, its document_problem()."""
    return kernel.problem(call) or (kernel.document_problem(call) if call.documents else "")


def refuse_dropout(kernel: str, dropout_p: float) -> None:
    if dropout_p > 0:
        raise ValueError(f"{kernel} attention has no attention dropout: set dropout=0 or use attn_backend=chunked")
