"""copy_into: the memmove path copies exactly what copy_ copies, and anything it cannot
take (a cast, a strided view, a broadcast) goes to torch's own copy."""

import pytest
import torch

from moepec.state.bytecopy import copy_into


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_contiguous_copy_is_exact(dtype):
    src = (torch.randn(3, 5, 7) * 100).to(dtype)
    dst = torch.zeros_like(src)
    copy_into(dst, src)
    assert torch.equal(dst, src)
    assert dst.data_ptr() != src.data_ptr()


def test_slices_of_a_stacked_tensor():
    stacked = torch.zeros(4, 8, 16)
    parts = [torch.full((8, 16), float(e)) for e in range(4)]
    for e, p in enumerate(parts):
        copy_into(stacked[e], p)
    assert torch.equal(stacked, torch.stack(parts))


def test_what_memmove_cannot_take_goes_to_copy_():
    dst = torch.zeros(6, 4)
    copy_into(dst.t(), torch.arange(24.0).view(4, 6))  # strided target
    assert torch.equal(dst.t(), torch.arange(24.0).view(4, 6))
    half = torch.zeros(3, dtype=torch.float16)
    copy_into(half, torch.tensor([1.5, 2.5, 3.5]))  # a cast
    assert half.tolist() == [1.5, 2.5, 3.5]
    row = torch.zeros(2, 3)
    copy_into(row, torch.tensor([1.0, 2.0, 3.0]))  # a broadcast
    assert torch.equal(row, torch.tensor([[1.0, 2.0, 3.0]] * 2))
    empty = torch.empty(0)
    copy_into(empty, torch.empty(0))


def test_autograd_sees_the_copy_as_it_sees_copy_():
    """The version counter moves (a saved tensor of a graph is known to be changed), and a
    leaf that requires grad refuses the copy outside no_grad, as ``copy_`` does."""
    dst, src = torch.zeros(1024), torch.randn(1024)
    version = dst._version
    copy_into(dst, src)
    assert torch.equal(dst, src) and dst._version > version
    leaf = torch.nn.Parameter(torch.zeros(1024))
    with pytest.raises(RuntimeError, match="leaf Variable"):
        copy_into(leaf, src)
    with torch.no_grad():
        copy_into(leaf, src)
    assert torch.equal(leaf.detach(), src)


def test_copy_all_copies_small_and_large_alike():
    """copy_all: the small tensors (one torch call) and the large ones (a memmove each),
    a cast and a strided view among them, land as copy_ puts them, and autograd records
    nothing on the buffers even from sources that require grad."""
    from moepec.state.bytecopy import SERIAL_NUMEL, copy_all

    big = torch.nn.Parameter(torch.randn(SERIAL_NUMEL + 3))
    srcs = [torch.randn(5, requires_grad=True), big, torch.arange(12.0).view(3, 4),
            torch.tensor([1.5, 2.5]), torch.randn(2, SERIAL_NUMEL)]
    dsts = [torch.zeros(5), torch.zeros(SERIAL_NUMEL + 3), torch.zeros(4, 3).t(),
            torch.zeros(2, dtype=torch.float16), torch.zeros(2, SERIAL_NUMEL)]
    copy_all(zip(dsts, srcs, strict=True))
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d, s.detach().to(d.dtype))
        assert not d.requires_grad and d.grad_fn is None
