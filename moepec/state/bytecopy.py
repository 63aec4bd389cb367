"""One copy of a tensor's bytes into another, on the calling thread.

The snapshot, the restore and the RAM tier copy hundreds to thousands of tensors one by
one (one per expert slice at K=1). ``Tensor.copy_`` runs every copy above a few tens of
kB as a parallel region of torch's intra-op thread pool: each one wakes the pool's
threads and waits for all of them. On a busy host (or next to a training thread that
keeps the cores) that wait is a scheduler time slice, not a memcpy: measured on this
project's 2-core machine at load 13, 64 copies of 0.2 MB took 180-280 ms with two torch
threads and 10-24 ms with one (docs/results.md, section 8). A plain ``memmove`` on the
calling thread costs what the bytes cost, whatever the pool is doing, and releases the
GIL while it runs (ctypes releases it around every foreign call).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided


def plain(t: torch.Tensor) -> bool:
    """A dense CPU tensor whose bytes are its values in order (no wrapper subclass)."""
    return (type(t) in _PLAIN_TYPES and t.is_cpu and t.layout is _STRIDED
            and t.is_contiguous() and not (t.is_conj() or t.is_neg() or t.is_quantized))


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``: one ``memmove`` on this thread when both are contiguous CPU
    tensors of one dtype and shape, else torch's own copy (another device, a cast, a
    broadcast, a strided view, a copy autograd records). Any thread; blocks until the
    bytes are copied. Bumps ``dst``'s version counter, as ``copy_`` does."""
    if (dst.dtype == src.dtype and dst.shape == src.shape and plain(dst) and plain(src)
            and not (dst.requires_grad and torch.is_grad_enabled())):
        n = dst.numel() * dst.element_size()
        if n:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
            torch.autograd.graph.increment_version(dst)
        return
    dst.copy_(src)


SERIAL_NUMEL = 32768
"""torch's intra-op grain size (``at::internal::GRAIN_SIZE``): a ``copy_`` of fewer
elements runs on the calling thread, never as a parallel region of the pool."""


def copy_all(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], threads: int = 1) -> None:
    """``dst.copy_(src)`` for every ``(dst, src)`` pair, as cheaply per pair as possible.

    A snapshot is hundreds of copies (616 at K=1 on gpt-125m-8e/4), most of them a few kB
    (norms, biases, routers, Adam's step counts) and a few holding nearly all the bytes
    (150 of them 99.5%). What a pair costs beside its bytes is reading its tensors'
    metadata, and after tens of MB of streaming copies that metadata is out of the CPU's
    caches: ~8 us a pair where a warm check costs ~3 us (docs/results.md, section 3,
    issue 50's fifth pass). So the metadata is read in one pass first, while it is warm
    from the caller's building of ``pairs``: the small pairs (under
    :data:`SERIAL_NUMEL` elements, serial in torch) go to one ``torch._foreach_copy_``
    call (one GIL release, ~0.5 us each), made next, and each large one becomes three
    integers (addresses and length) for a ``memmove`` loop that touches nothing else.
    Pairs :func:`copy_into` would hand to torch go to ``copy_`` last. Copies under
    ``no_grad``: autograd records nothing (the sources are live parameters; the copies
    are data). With ``threads`` > 1 the ``memmove``s of at least
    :data:`PARALLEL_BYTES` in all are split by bytes over that many threads, the caller
    one of them (a restore's copies into the model: ``memmove`` releases the GIL, so they
    use the cores a ``dcp.load`` uses; the snapshot keeps one). Any thread; blocks until
    every byte is copied; bumps each ``dst``'s version counter.

    With ``threads`` 1 and one torch thread, all of that is one :func:`foreach_serial`
    instead: torch's copies then never enter the pool, and its loop in C++ reads each
    pair's metadata for less than Python does (the snapshot at K=1 above: 74-76% of a
    memcpy before, 83-85% after; docs/results.md, section 3, issue 50's eighth pass)."""
    pairs = list(pairs)
    if threads == 1 and foreach_serial([d for d, _ in pairs], [s for _, s in pairs]):
        return
    small_dst, small_src, moves, other = [], [], [], []
    with torch.no_grad():
        for dst, src in pairs:
            if dst.numel() < SERIAL_NUMEL and dst.is_cpu and src.is_cpu:
                small_dst.append(dst)
                small_src.append(src)
            elif (dst.dtype == src.dtype and dst.shape == src.shape and plain(dst)
                  and plain(src) and not (dst.requires_grad and torch.is_grad_enabled())):
                if n := dst.nbytes:
                    moves.append((dst.data_ptr(), src.data_ptr(), n))
                    torch.autograd.graph.increment_version(dst)
            else:
                other.append((dst, src))
        if small_dst:
            torch._foreach_copy_(small_dst, small_src)
        _move_all(moves, threads)
        for dst, src in other:
            dst.copy_(src)


def copy_laid_out(base: int, offsets: Sequence[int], tensors: Sequence[torch.Tensor],
                  views: Sequence[torch.Tensor]) -> None:
    """``views[i].copy_(tensors[i])`` for every ``i``, where ``views[i]`` is the tensor at
    ``base + offsets[i]`` that this library laid out for exactly ``tensors[i]``'s shape
    and dtype (a shared-memory slot) and no autograd graph holds.

    A snapshot is hundreds of tensors, and reading each one's metadata in Python is
    what it costs beside its bytes (docs/results.md, section 3, issue 50's eighth pass).
    So with one torch thread it is one :func:`foreach_serial`; otherwise each source is
    read once (none of ``views`` is: the addresses are ``base`` and ``offsets``) for a
    ``memmove`` loop. Any thread; blocks until every byte is copied."""
    if foreach_serial(views, tensors):
        return
    moves, other = [], []
    for i, (t, offset) in enumerate(zip(tensors, offsets, strict=True)):
        if (type(t) in _PLAIN_TYPES and t.is_cpu and t.layout is _STRIDED  # plain, inline
                and t.is_contiguous() and not (t.is_conj() or t.is_neg() or t.is_quantized)):
            moves.append((base + offset, t.data_ptr(), t.nbytes))
        else:
            other.append(i)
    _move_all(moves, 1)
    with torch.no_grad():
        for i in other:
            views[i].copy_(tensors[i])


def foreach_serial(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> bool:
    """``dst.copy_(src)`` for every pair as one ``torch._foreach_copy_`` (a loop in C++:
    no Python per pair) when torch runs its copies on the calling thread (one intra-op
    thread: ``copy_`` never enters the pool) and every tensor is a plain tensor or
    parameter (no subclass); returns whether it copied. Under ``no_grad``."""
    if torch.get_num_threads() != 1 or not (all(type(t) in _PLAIN_TYPES for t in srcs)
                                            and all(type(t) in _PLAIN_TYPES for t in dsts)):
        return False
    if dsts or srcs:  # (torch refuses empty lists; nothing to copy)
        with torch.no_grad():
            torch._foreach_copy_(list(dsts), list(srcs))
    return True


PARALLEL_BYTES = 16 << 20
"""The fewest bytes that are split over threads (:func:`copy_all`, the restore's checksum
checks): below it, starting a thread costs about what it saves."""

T = TypeVar("T")
MAX_RESTORE_THREADS = 2
"""The most threads a restore's checks and copies use: two already take the memory
bandwidth a copy can use on this project's machine (docs/results.md, section 8)."""


def restore_threads() -> int:
    """Threads for a restore's checksum checks and copies: torch's intra-op threads (what
    a ``dcp.load`` would use; a user who set 1 gets 1), at most
    :data:`MAX_RESTORE_THREADS`."""
    return max(1, min(MAX_RESTORE_THREADS, torch.get_num_threads()))


def in_threads(work: Callable[[list[T]], None], shares: Sequence[list[T]]) -> None:
    """``work(share)`` for every share, the first on this thread and each other on a
    thread of its own, started here and joined before returning (so ``work`` must
    release the GIL for most of its time to gain anything). Re-raises the first error a
    share raised, once all are done."""
    errors: list[BaseException] = []

    def run(share: list[T]) -> None:
        try:
            work(share)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller
            errors.append(exc)

    helpers = [threading.Thread(target=run, args=(share,), name="moepec-share", daemon=True)
               for share in shares[1:]]
    for t in helpers:
        t.start()
    if shares:
        run(shares[0])
    for t in helpers:
        t.join()  # bounded work (copies, hashes of bytes in memory): it ends
    if errors:
        raise errors[0]


def split_by_bytes(jobs: Sequence[T], size: Callable[[T], int], parts: int
                   ) -> list[list[T]]:
    """``jobs`` in at most ``parts`` consecutive shares of about equal bytes (``size`` of
    each; a job is never cut), one share when they hold under :data:`PARALLEL_BYTES`."""
    if not jobs:
        return []
    sizes = [size(j) for j in jobs]
    total = sum(sizes)
    if parts < 2 or total < PARALLEL_BYTES:
        return [list(jobs)]
    shares: list[list[T]] = [[]]
    per, done = total / parts, 0
    for job, n in zip(jobs, sizes, strict=True):
        if done >= per * len(shares) and len(shares) < parts:
            shares.append([])
        shares[-1].append(job)
        done += n
    return shares


def _move_all(moves: list[tuple[int, int, int]], threads: int) -> None:
    """``memmove(to, frm, n)`` for every move, split by bytes over ``threads`` threads
    (this one included, a move cut where a share ends) when they hold
    :data:`PARALLEL_BYTES` or more."""
    total = sum(n for _, _, n in moves)
    shares = (_cut(moves, -(-total // threads)) if threads > 1 and total >= PARALLEL_BYTES
              else [moves])

    def move(share: list[tuple[int, int, int]]) -> None:
        for to, frm, n in share:
            ctypes.memmove(to, frm, n)

    in_threads(move, shares)


def _cut(moves: list[tuple[int, int, int]], per: int) -> list[list[tuple[int, int, int]]]:
    """``moves`` cut into consecutive shares of ``per`` bytes (the last may hold less),
    a move that straddles a boundary cut in two."""
    shares: list[list[tuple[int, int, int]]] = [[]]
    room = per
    for to, frm, n in moves:
        while n > room:
            if room:
                shares[-1].append((to, frm, room))
                to, frm, n = to + room, frm + room, n - room
            shares.append([])
            room = per
        shares[-1].append((to, frm, n))
        room -= n
    return [s for s in shares if s]
