"""`ddtree.host_tensors`: the decode round's small tensors, equal to `torch.tensor`'s."""
from __future__ import annotations

import pytest
import torch

from ddtree.host_tensors import double_tensor, long_tensor


@pytest.mark.parametrize("values", [[], [0], [5, -3, 2**62, -(2**63)], list(range(300))])
def test_long_tensor_equals_torch_tensor(values):
    ours = long_tensor(values)
    assert ours.dtype == torch.int64 and ours.shape == (len(values),)
    assert torch.equal(ours, torch.tensor(values, dtype=torch.int64))
    other = long_tensor(values)
    ours[:1] = 7  # writable, and each tensor owns its memory
    assert torch.equal(other, torch.tensor(values, dtype=torch.int64))


@pytest.mark.parametrize("values", [[], [0.5], [-0.0, float("inf"), float("-inf"), 1e-310, 0.1]])
def test_double_tensor_keeps_every_bit(values):
    ours = double_tensor(values)
    assert ours.dtype == torch.float64
    assert ours.tolist() == values and [str(v) for v in ours.tolist()] == [str(v) for v in values]


def test_long_tensor_refuses_what_torch_tensor_would_not_store_exactly():
    with pytest.raises(TypeError):
        long_tensor([1.5])
    with pytest.raises(OverflowError):
        long_tensor([2**63])


def test_long_tensor_moves_to_the_device_asked_for():
    assert long_tensor([1, 2], "cpu").device.type == "cpu"
    assert long_tensor([], "cpu").device.type == "cpu"
