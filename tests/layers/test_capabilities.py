"""The variant contract: a mixer with the runtime core alone trains and generates, and each tool either skips it
with a note or refuses it with what to define; attention under an edge rule has every capability from its rule."""

import dataclasses

import pytest
import torch
from torch import nn

from runtime import memory_plan
from attention import capabilities
from attention.capabilities import (ActivationMemory, BoundaryWriteBack, EdgeCounts, HeadWindows, KernelBench,
                                    PretrainedAttention, Reachability, WindowSchedule)
from attention.memory import Kernels
from attention.registry import MIXERS, Mixer, build_mixer, has_window_layers
from config import ModelConfig
from conftest import load_script
from model import GPT


class CumulativeMean(Mixer):
    """The runtime core and nothing else: each position reads the mean of the positions up to it, projected."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, call):
        counts = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[None, :, None]
        return self.proj(x.cumsum(1) / counts)


@pytest.fixture
def bare(monkeypatch):
    monkeypatch.setitem(MIXERS, "cumulative_mean", CumulativeMean)
    return ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=32, vocab_size=50, attn_pattern="cumulative_mean")


def test_a_mixer_with_the_core_alone_trains_and_generates(bare):
    model = GPT(bare)
    idx = torch.randint(0, 50, (2, 32), generator=torch.Generator().manual_seed(0))
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and model.blocks[0].mixer.proj.weight.grad is not None
    with pytest.raises(ValueError, match="CumulativeMean does not declare takes_documents"):  # said, not a TypeError mid-run
        GPT(dataclasses.replace(bare, document_mask=True, eot_id=3))
    assert model.set_window(8) == 0 and not has_window_layers(bare)  # no window to schedule: nothing changes
    # no init_cache: generation re-runs the context, as it does for sa
    assert not model.blocks[0].mixer.supports_cache
    assert model.generate(idx[:1, :4], max_new_tokens=3).shape == (1, 7)


def test_the_tools_skip_or_refuse_a_mixer_without_their_capability(bare):
    mixer = build_mixer(bare, 0)
    for capability in (EdgeCounts, Reachability, HeadWindows, WindowSchedule, BoundaryWriteBack, KernelBench,
                       ActivationMemory, PretrainedAttention):
        assert not isinstance(mixer, capability), capability
    assert capabilities.head_windows(mixer) is None and capabilities.write_back_coverage(mixer, 32) is None
    assert capabilities.expected_graph_breaks(mixer, "cpu", torch.float32) == ""
    assert "parameters or state of its own" in capabilities.pretrained_problem(mixer)
    assert capabilities.example_settings(CumulativeMean, 64) == {} and capabilities.gpu_kernel(CumulativeMean) is None
    model = GPT(bare)
    mask_stats = load_script("mask_stats")
    assert [row["heads"] for row in mask_stats.layer_stats(model, 32, 8)] == [None, None]  # no edges to count
    assert all(row["edges_assumed_causal"] for row in mask_stats.receptive_field(model, 32))  # and said so
    with pytest.raises(NotImplementedError, match="define saved_activations .* ActivationMemory"):
        memory_plan.block_activations(model.blocks[0], bare, Kernels("cpu"), 1, 32)


def test_attention_under_a_rule_has_every_capability_its_edges_give():
    config = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=50, attn_pattern="swa",
                         swa_window=8)
    swa = build_mixer(config, 0)
    for capability in (EdgeCounts, Reachability, HeadWindows, WindowSchedule, KernelBench, ActivationMemory,
                       PretrainedAttention):
        assert isinstance(swa, capability), capability
    assert not isinstance(swa, BoundaryWriteBack)  # paper 004's bridges only
    assert capabilities.head_windows(swa) == [8, 8] and capabilities.pretrained_problem(swa) == ""
    assert capabilities.set_window(swa, 4) and capabilities.head_windows(swa) == [4, 4]
    recurrent = build_mixer(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=50,
                                        attn_pattern="mlstm", mlstm_n_head=2), 0)
    assert isinstance(recurrent, Reachability) and isinstance(recurrent, KernelBench) \
        and isinstance(recurrent, ActivationMemory) and not isinstance(recurrent, EdgeCounts)
