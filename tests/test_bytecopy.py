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


@pytest.fixture(params=[1, 2], ids=["one-torch-thread", "two-torch-threads"])
def torch_threads(request):
    """Each copy path: one torch thread (one ``torch._foreach_copy_``) and more (memmoves)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_foreach_serial_only_with_one_torch_thread_and_plain_tensors(torch_threads):
    from moepec.state.bytecopy import foreach_serial

    class Marked(torch.Tensor):
        pass

    dst, src = torch.zeros(8), torch.randn(8)
    assert foreach_serial([dst], [src]) is (torch_threads == 1)
    assert torch.equal(dst, src) is (torch_threads == 1)
    assert not foreach_serial([dst], [src.as_subclass(Marked)])  # a subclass: copy_ per pair
    assert foreach_serial([], []) is (torch_threads == 1)  # nothing to copy: no error


def test_nothing_to_copy_is_no_error(torch_threads):
    from moepec.state.bytecopy import copy_all, copy_laid_out

    copy_all([])
    copy_laid_out(0, [], [], [])


def test_copy_all_and_copy_laid_out_copy_exactly_on_either_path(torch_threads):
    """The snapshot's two copies (into pooled buffers, into a laid-out slot) land what
    ``copy_`` lands, with a strided and an empty source among them, and autograd records
    nothing on the buffers even from sources that require grad."""
    from moepec.state.bytecopy import SERIAL_NUMEL, copy_all, copy_laid_out

    srcs = [torch.randn(5, requires_grad=True), torch.nn.Parameter(torch.randn(SERIAL_NUMEL + 3)),
            torch.arange(12.0).view(3, 4).t(), torch.empty(0), torch.randn(2, SERIAL_NUMEL),
            torch.arange(7, dtype=torch.int64)]
    dsts = [torch.zeros(s.shape, dtype=s.dtype) for s in srcs]
    copy_all(zip(dsts, srcs, strict=True))
    offsets, end = [], 0
    for s in srcs:
        offsets.append(end)
        end += (s.nbytes + 63) // 64 * 64
    base = torch.zeros(end, dtype=torch.uint8)
    views = [base[o:o + s.nbytes].view(s.dtype).view(s.shape) for o, s in zip(offsets, srcs)]
    copy_laid_out(base.data_ptr(), offsets, srcs, views)
    for s, d, v in zip(srcs, dsts, views, strict=True):
        assert torch.equal(d, s.detach()) and torch.equal(v, s.detach())
        assert not d.requires_grad and d.grad_fn is None and v.grad_fn is None
