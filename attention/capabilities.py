"""What the tools ask of a mixer beyond its runtime core (attention/registry.py: Mixer).

A variant implements the core: forward, and where its defaults do not fit plan, init_cache, settings and
check_config, init_weights, mixing_flops, compile_key and compile_problem. Everything else here is optional: a
capability is a Protocol a tool looks for with isinstance, skipping a mixer without it with a note (or, where
a tool cannot go on without it, refusing with what to define). Attention under edge rules
(attention/layer.py: MaskedAttention) has every capability that follows from edges, derived from its rule; a
recurrent mixer declares the ones it has (attention/mlstm.py).

    capability           methods                                     used by
    EdgeCounts           edge_counts(seq_len)                        scripts/mask_stats.py, bench_attention.py
    Reachability         edge_mask(seq_len, device)                  mask_stats.py's receptive field, coverage
    HeadWindows          head_windows()                              mask_stats.py's summed-window cost
    WindowSchedule       set_window(window)                          train.py's window schedule (paper 003),
                                                                     sample.py and eval's --window
    BoundaryWriteBack    write_back_coverage(seq_len)                paper 004's bridges (mask_stats.py)
    KernelBench          kernel_inputs(...), kernel_forward(...)     bench_attention.py, the GPU check's backends
    ActivationMemory     saved_activations(config, kernels, B, T)    runtime/memory_plan.py (scripts/plan_memory.py)
    PretrainedAttention  pretrained_problem()                        variants in Hugging Face models (hf.py)

Declarations a class may carry (read with the functions at the end): example_settings(window) (every tool's
small model), check_variants (extra cases the checks run), gpu_kernel (a GPU kernel the GPU check demands),
expected_graph_breaks(device, dtype) (compile_check.py) and resolved_settings(seq_len, device, dtype) (what its
"auto" settings become: config.json's "resolved", which compare shows).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from attention.kernels import layer_scores


@runtime_checkable
class EdgeCounts(Protocol):
    def edge_counts(self, seq_len: int) -> list[tuple[int, int]]:
        """Per head: (attention scores computed, unique allowed edges) over seq_len tokens. They differ for
        variants with several separately normalised branches (branch vs union form)."""


@runtime_checkable
class Reachability(Protocol):
    def edge_mask(self, seq_len: int, device="cpu") -> torch.Tensor:
        """(seq_len, seq_len) boolean: can information move from key position k to query position q in this
        layer through any head (the union of its edges; all causal pairs for recurrent mixers)."""


@runtime_checkable
class HeadWindows(Protocol):
    def head_windows(self) -> list[int] | None:
        """The window of each head, for sliding-window mixers (None: its windows are not over recent positions)."""


@runtime_checkable
class WindowSchedule(Protocol):
    def set_window(self, window: int) -> bool:
        """Use a sliding window of `window` positions from now on; returns whether this layer has such a window."""


@runtime_checkable
class BoundaryWriteBack(Protocol):
    def write_back_coverage(self, seq_len: int) -> int:
        """Positions given an auxiliary path's output (paper 004's bridges)."""


@runtime_checkable
class KernelBench(Protocol):
    def kernel_inputs(self, batch: int, seq_len: int, device, dtype, generator=None) -> tuple:
        """Random inputs (requiring grad) of the token-mixing kernel at this length: what kernel_forward takes."""

    def kernel_forward(self, *inputs) -> torch.Tensor:
        """The token-mixing kernel as the layer computes it (no projections) on kernel_inputs' tensors."""


@runtime_checkable
class ActivationMemory(Protocol):
    def saved_activations(self, config, kernels, B: int, T: int) -> tuple[dict[str, int], int]:
        """What the mixer keeps for backward over B x T tokens, in bytes, on the kernels of `kernels`
        (attention/memory.py: Kernels): (saved tensors by name, the part selective checkpointing keeps)."""


@runtime_checkable
class PretrainedAttention(Protocol):
    def pretrained_problem(self) -> str:
        """Why this mixer cannot run inside a pretrained transformer's attention ("" when it can)."""


def own_state_problem(mixer) -> str:
    return (f"{type(mixer).__name__} has parameters or state of its own that a pretrained model does not have: "
            "only attention under edge rules (and moba) runs inside a pretrained model's attention")


def pretrained_problem(mixer) -> str:
    """Why `mixer` cannot stand in for a pretrained model's attention ("" when it can): its own answer, or, for
    a mixer without the capability, that it has parameters or state a pretrained model does not have."""
    return mixer.pretrained_problem() if isinstance(mixer, PretrainedAttention) else own_state_problem(mixer)


def head_windows(mixer) -> list[int] | None:
    return mixer.head_windows() if isinstance(mixer, HeadWindows) else None


def write_back_coverage(mixer, seq_len: int) -> int | None:
    return mixer.write_back_coverage(seq_len) if isinstance(mixer, BoundaryWriteBack) else None


def set_window(mixer, window: int) -> bool:
    return isinstance(mixer, WindowSchedule) and mixer.set_window(window)


def example_settings(cls, window: int) -> dict:
    """Settings (ModelConfig keys, n_layer among them where the variant needs a depth) of a small model of this
    mixer whose windows and blocks are about `window` positions: the tools' small models ({} when it needs none)."""
    declared = getattr(cls, "example_settings", None)
    return declared(window) if declared else {}


def check_variants(cls) -> dict:
    """Cases the checks run besides a mixer's example settings: label -> settings (the bridges' union fusion)."""
    return getattr(cls, "check_variants", {})


def gpu_kernel(cls) -> tuple | None:
    """A GPU kernel the mixer trains with when installed: (setting, the value that demands it, its package, the
    text the layer's describe() line then shows), or None. scripts/gpu_check.py runs it and checks its use."""
    return getattr(cls, "gpu_kernel", None)


def expected_graph_breaks(mixer, device, dtype) -> str:
    """Why compiling this layer breaks its graph by design on this device and dtype ("" when it must not)."""
    declared = getattr(mixer, "expected_graph_breaks", None)
    return declared(device, dtype) if declared else ""


def resolved_settings(mixer, seq_len: int, device, dtype) -> dict:
    """What the mixer's "auto" settings become at this length, device and dtype ({setting: value}): its own
    declaration where it has one, else for attention the kernels its plan picks (attn_backend)."""
    declared = getattr(mixer, "resolved_settings", None)
    if declared is not None:
        return declared(seq_len, device, dtype)
    if getattr(mixer, "backend", None) == "auto" and hasattr(mixer, "plan"):
        kernels, _ = layer_scores(mixer, seq_len, device)
        if kernels != "its own kernel":
            return {"attn_backend": kernels}
    return {}
