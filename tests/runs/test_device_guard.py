"""The device guard of the gpu tests (tests/conftest.py): on a machine without CUDA, a gpu test's body runs on the
CPU with every tensor that test code makes without naming a device turned into a meta tensor, so that the mix of
a CPU tensor and the test device's tensors fails here as it would on a GPU."""

import pytest
import torch

from attention.edges import SlidingWindow
from attention.kernels import attend
from attention.ops.dense import dense_attention
from conftest import DeviceGuard, generator


def device_inputs(device="cpu"):
    return torch.randn(1, 2, 40, 8, generator=generator(0, device), device=device, requires_grad=True)


def test_a_gradient_probe_made_without_a_device_fails_under_the_guard():
    q = device_inputs()
    with DeviceGuard():
        y = attend(q, q, q, SlidingWindow(8), "chunked")  # the library makes its own tensors on q's device
        probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)  # no device
        assert probe.device.type == "meta"
        with pytest.raises(RuntimeError, match="expected device cpu but got meta"):
            torch.autograd.grad(y, q, probe)
        good = torch.randn(y.shape, generator=generator(1, y.device), dtype=y.dtype, device=y.device)
        assert torch.autograd.grad(y, q, good)[0].device == q.device


def test_positions_made_without_a_device_fail_under_the_guard():
    q = device_inputs()
    with DeviceGuard():
        with pytest.raises(RuntimeError, match="meta"):
            dense_attention(q, q, q, SlidingWindow(8), torch.arange(40))
        dense_attention(q, q, q, SlidingWindow(8), torch.arange(40, device=q.device))
        with pytest.raises(RuntimeError, match="meta"):  # made without a device, then moved: refused as well
            torch.randn(3).to("cpu")


def test_outside_the_guard_and_outside_tests_tensors_keep_the_default_device():
    assert torch.randn(3).device.type == "cpu"
    with DeviceGuard():
        assert torch.zeros(3, device="cpu").device.type == "cpu"
        assert SlidingWindow(8).dense_mask(torch.arange(4, device="cpu")).device.type == "cpu"
