"""torchrun worker for tests/test_megatron.py: every load that Megatron-Core's ``torch_dist``
refuses, reports or loads, done on a ``torch_dist`` folder and on a ``("moepec", 1)``
folder of the same state, with the same outcome on both.

    python -m torch.distributed.run --nproc_per_node 2 tests/megatron_strict.py DIR

Cases (after Megatron's own test_tensor_shape_mismatch and TestNonStrictLoad): a load of
another global shape (smaller and larger), rigid and with ``allow_shape_mismatch``; keys
the folder lacks ("unexpected") and keys nobody asks for ("missing"), and an exact load,
each under every ``StrictHandling`` mode. An outcome is: raised (and whether as
Megatron's CheckpointingException and as DCP's CheckpointException, as torch_dist
raises), or the loaded values (bit for bit), the returned missing and unexpected keys and
the keys named in Megatron's warnings. Also: the moepec saves of a state without experts
warn once, on rank 0, that they found none (a UserWarning), and the saves and exact loads
log nothing (Megatron's test_exact_load_handling). Prints ``rank R STRICT OK N``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable

if __name__ == "__main__":
    # Only here: torch_dist's save spawns a helper process that runs this file's top
    # again (as __mp_main__); without torch and Megatron to import it starts in a moment.
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    sys.path.insert(0, os.path.dirname(__file__))
    import megatron_shims

    megatron_shims.install()

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import (
        CheckpointingException,
        ShardedObject,
        ShardedTensor,
    )
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException

    import moepec.integrations.megatron  # noqa: F401  (registers ("moepec", 1))
    import moepec.store.flat as flat_store
    from moepec.keys import MANIFEST_NAME

RANK = WORLD = 0


class Lines(logging.Handler):
    """The WARNING lines of a logger, kept."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def base() -> dict:
    """Megatron's TestNonStrictLoad state (replicated, split and object shards) and a
    tensor per shape case, split over the ranks on axis 1: global (2, 16 * WORLD)."""
    local = torch.arange(16).unsqueeze(0).expand(2, 16) + RANK * 16
    return {
        "TenA": ShardedTensor.from_rank_offsets("TenA", torch.arange(2), replica_id=RANK),
        "TenB": ShardedTensor.from_rank_offsets("TenB", torch.arange(3), (0, RANK, WORLD),
                                                replica_id=0),
        "ObjA": ShardedObject("ObjA", list(range(10)), (1,), (0,), replica_id=RANK),
        "ObjB": ShardedObject("ObjB", {RANK + 7}, (1, WORLD), (0, RANK), replica_id=0),
        "rigid": ShardedTensor.from_rank_offsets("keyA", local.clone(), (1, RANK, WORLD)),
        "flexible": ShardedTensor.from_rank_offsets("keyB", local.clone(), (1, RANK, WORLD),
                                                    allow_shape_mismatch=True),
    }


def outcome(folder: str, request: dict, strict: StrictHandling, integrity: bool = True):
    """What a load does: ('raised', is CheckpointingException, is DCP's
    CheckpointException, message) or ('loaded', values, missing, unexpected, keys named
    in Megatron's warnings)."""
    lines = Lines()
    logging.getLogger("megatron.core.dist_checkpointing").addHandler(lines)
    try:
        out = dist_checkpointing.load(request, folder, validate_access_integrity=integrity,
                                      strict=strict)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - compared below
        return ("raised", isinstance(exc, CheckpointingException),
                isinstance(exc, CheckpointException), str(exc))
    finally:
        logging.getLogger("megatron.core.dist_checkpointing").removeHandler(lines)
    missing = unexpected = None
    if isinstance(out, tuple):
        out, missing, unexpected = out
    named = sorted(k for k in ("TenA", "ObjB", "UnexpectedTenD", "UnexpectedObjD")
                   if any(k in line for line in lines.lines))
    return ("loaded", out, missing, unexpected, named)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k])
                                                                     for k in a)
    return a == b


def shape_case(width: int, flexible: bool) -> dict:
    """A load of a shape-case tensor at another global shape (2, width * WORLD)."""
    name, key = ("flexible", "keyB") if flexible else ("rigid", "keyA")
    return {name: ShardedTensor.from_rank_offsets(
        key, torch.ones(2, width, dtype=torch.int64), (1, RANK, WORLD),
        allow_shape_mismatch=flexible)}


def unexpected() -> dict:
    sd = base()
    sd["TenD"] = ShardedTensor.from_rank_offsets("UnexpectedTenD", torch.arange(3),
                                                 replica_id=RANK)
    sd["ObjD"] = ShardedObject("UnexpectedObjD", None, (1,), (0,), replica_id=RANK)
    return sd


def missing() -> dict:
    sd = base()
    del sd["TenA"], sd["ObjB"]
    return sd


def compare(case: str, ref, got) -> None:
    assert ref[0] == got[0], f"{case}: torch_dist {ref[0]} ({ref[-1]!s:.300}), moepec " \
                             f"{got[0]} ({got[-1]!s:.300})"
    if ref[0] == "raised":
        # what catches torch_dist's exception (Megatron's class, DCP's) catches moepec's
        assert got[1] >= ref[1] and got[2] >= ref[2], f"{case}: {ref} vs {got}"
        return
    for i, what in ((1, "values"), (2, "missing keys"), (3, "unexpected keys"),
                    (4, "keys in warnings")):
        assert same(ref[i], got[i]), f"{case}: {what}: torch_dist {ref[i]}, moepec {got[i]}"


def fully_parallel(root: str, ref: str) -> None:
    """What Megatron-LM's --ckpt-fully-parallel-save/-load and
    --ckpt-assume-constant-structure reach in megatron-core, around the moepec strategies:
    Megatron's FullyParallelSaveStrategyWrapper (cached distribution),
    ``use_cached_ckpt_structure`` on the save strategy, a sync save and an async one
    through Megatron's request queue; the load equals the torch_dist load of the same
    state."""
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )

    inner = get_default_save_sharded_strategy("moepec", 1)
    inner.use_cached_ckpt_structure = True
    save = FullyParallelSaveStrategyWrapper(inner, None, True)
    queue = AsyncCallsQueue()
    for i in (1, 2):
        folder = make(os.path.join(root, "parallel", f"iter_{i:07d}"))
        request = dist_checkpointing.save(base(), folder, save, async_sharded_save=i == 2)
        if i == 2:
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    # Megatron's FullyParallelLoadStrategyWrapper exchanges the loaded shards through CUDA
    # tensors (exchange_utils: .cuda()), with any backend: on CPU only its construction
    # and the base strategy it wraps are checked; the load is the plain one.
    load = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(folder), None, True)
    assert type(load.base_strategy).__name__ == "MoepecLoadStrategy"
    got = dist_checkpointing.load(base(), folder)
    want = dist_checkpointing.load(base(), ref)
    assert same(got, want), (got, want)


N_EXPERTS = 4
EXPERT_KEY = "decoder.layers.mlp.experts.experts.linear_fc1.weight"


def moe(step: int) -> dict:
    """:func:`base` and one MoE layer of N_EXPERTS experts, SequentialMLP's layout (layer
    axis, expert axis prepended), split over the ranks (EP = world size); expert e holds
    100 * step + e, and a replicated non-expert tensor holds step."""
    sd = {**base(), "dense": ShardedTensor.from_rank_offsets(
        "dense", torch.full((4,), float(step)), replica_id=RANK)}
    per = N_EXPERTS // WORLD
    for e in range(RANK * per, (RANK + 1) * per):
        sd[f"expert{e}"] = ShardedTensor.from_rank_offsets(
            EXPERT_KEY, torch.full((3, 5), float(100 * step + e)), (0, 0, 1),
            (1, e, N_EXPERTS), prepend_axis_num=2)
    return sd


def backend_of(folder: str) -> str:
    with open(os.path.join(folder, "metadata.json")) as f:
        return json.load(f)["sharded_backend"]


def experts_saved(folder: str) -> list:
    with open(os.path.join(folder, "moepec.json")) as f:
        return json.load(f)["experts_saved"]


def switch(root: str, ref: str) -> None:
    """moepec.integrations.megatron.use_for_torch_dist, as Megatron-LM's save_checkpoint
    meets it with --ckpt-format torch_dist: ``get_default_save_sharded_strategy('torch_dist')``
    with --ckpt-assume-constant-structure's attribute, inside --ckpt-fully-parallel-save's
    wrapper (cached distribution), a sync and an async save (the request queue), and
    ``dist_checkpointing.save`` / ``load`` without a strategy: K = 1 of 4 experts after
    the first save, loaded stitched bit for bit; a stock torch_dist folder still loads
    (a resume from stock); switched off, the default save is torch_dist again."""
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.base import default_strategies
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistSaveShardedStrategy,
    )

    import moepec.integrations.megatron as mg

    mg.use_for_torch_dist(k_persist=1)
    mg.use_for_torch_dist(k_persist=1)  # idempotent: one switch, the same front end
    front = mg._front()
    mg.use_for_torch_dist(k_persist=1)
    assert mg._front() is front  # not re-registered: the schedule's state is kept
    assert type(default_strategies["save_sharded"]).__name__ == "AnsweringTable"
    folders = [make(os.path.join(root, "switch", f"iter_{i:07d}")) for i in (1, 2, 3)]
    dist_checkpointing.save(moe(1), folders[0])  # no strategy: the default lookup
    save = get_default_save_sharded_strategy("torch_dist")  # as save_checkpoint asks
    assert isinstance(save, mg.MoepecSaveStrategy), save
    save.use_cached_ckpt_structure = True  # --ckpt-assume-constant-structure
    save = FullyParallelSaveStrategyWrapper(save, None, True)  # its cached distribution
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dist_checkpointing.save(moe(2), folders[1], save,
                                                         async_sharded_save=True))
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    assert [backend_of(f) for f in folders[:2]] == ["moepec", "moepec"]
    assert [len(experts_saved(f)) for f in folders[:2]] == [N_EXPERTS, 1]
    load = get_default_load_sharded_strategy(folders[1])  # as load_checkpoint asks
    assert isinstance(FullyParallelLoadStrategyWrapper(load, None, True).base_strategy,
                      mg.MoepecLoadStrategy)
    got = dist_checkpointing.load(moe(0), folders[1])  # no strategy: metadata.json's
    sources = mg.last_load_report().sources
    want = moe(2)
    for e in range(N_EXPERTS):  # the expert not saved at 2 is its copy of save 1
        step = 2 if sources[f"0/{e}"]["checkpoint"] == "iter_0000002" else 1
        if f"expert{e}" in want:
            want[f"expert{e}"].data.fill_(100 * step + e)
    assert same(got, {k: v.data for k, v in want.items()}), (got, want)
    assert sorted(s["checkpoint"] for s in sources.values()).count("iter_0000001") == 3
    stock = dist_checkpointing.load(base(), ref)  # a stock folder, the switch on
    assert same(stock, dist_checkpointing.load(base(), ref, ("torch_dist", 1)))
    mg.stop_using_for_torch_dist()
    mg.stop_using_for_torch_dist()  # undone once is undone
    assert type(default_strategies["save_sharded"]) is dict
    assert isinstance(get_default_save_sharded_strategy(), TorchDistSaveShardedStrategy)
    dist_checkpointing.save(moe(3), folders[2])
    assert backend_of(folders[2]) == "torch_dist"
    assert same(dist_checkpointing.load(moe(0), folders[2]),
                {k: v.data for k, v in moe(3).items()})


class Heard(logging.Handler):
    """Every record that pytest's ``caplog`` holds: a handler of no level on the root
    logger and on each logger that does not propagate (pytest attaches to those too, DCP's
    ``c10d-...-dcp_logger`` at DEBUG among them), no logger's level changed."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.lines: list[str] = []
        self.loggers: list[logging.Logger] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage():.200}")

    def __enter__(self) -> Heard:
        self.loggers = [logging.getLogger()] + [
            lg for lg in logging.Logger.manager.loggerDict.values()
            if isinstance(lg, logging.Logger) and not lg.propagate]
        for lg in self.loggers:
            lg.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for lg in self.loggers:
            lg.removeHandler(self)


def quiet(root: str) -> str:
    """Megatron's test_exact_load_handling: its saves and exact loads, in every
    StrictHandling mode, log nothing (it asserts ``caplog.text == ''`` over all of them).
    The saves of a state without experts say so once, on rank 0, as a UserWarning. A
    user's own DCP save is still traced (the capture sees it). Returns the last folder."""
    with warnings.catch_warnings(record=True) as told, Heard() as heard:
        warnings.simplefilter("always")
        for i in (1, 2):
            pec = make(os.path.join(root, "moepec", f"iter_{i:07d}"))
            dist_checkpointing.save(base(), pec, sharded_strategy=("moepec", 1))
        for mode in StrictHandling:
            dist_checkpointing.load(base(), pec, strict=mode)
    assert heard.lines == [], f"{len(heard.lines)} records: {heard.lines[:4]}"
    said = [str(w.message) for w in told if "no expert shards" in str(w.message)]
    assert len(said) == (1 if RANK == 0 else 0), [str(w.message) for w in told]
    with Heard() as probe:
        dcp.save({"x": torch.zeros(2)}, checkpoint_id=os.path.join(root, f"own{RANK}"),
                 no_dist=True)
    assert any("dcp_logger" in line for line in probe.lines), probe.lines
    return pec


def reads_once(folder: str) -> None:
    """A load reads the folder's manifest once per rank (it read it three times: for the
    shapes, the keys and the load); one whose StrictHandling mode checks the folder's keys
    once more, in Megatron's own call of load_sharded_metadata. Counted by wrapping the
    function that reads the file, which still reads it."""
    real, heads = flat_store.read_small, []

    def counted(path, *args, **kwargs):
        if os.path.basename(path) == MANIFEST_NAME:
            heads.append(os.path.relpath(path, os.path.dirname(folder)))
        return real(path, *args, **kwargs)

    for mode, reads in ((StrictHandling.ASSUME_OK_UNEXPECTED, 1), (StrictHandling.RAISE_ALL, 2)):
        heads.clear()
        flat_store.read_small = counted
        try:
            loaded = dist_checkpointing.load(base(), folder, strict=mode)
        finally:
            flat_store.read_small = real
        assert same(loaded, dist_checkpointing.load(base(), folder)), mode
        assert heads == [os.path.join(os.path.basename(folder), MANIFEST_NAME)] * reads, \
            (mode, heads)


def make(folder: str) -> str:
    if RANK == 0:
        os.makedirs(folder)
    dist.barrier()
    return folder


def main() -> None:
    global RANK, WORLD
    root = sys.argv[1]
    dist.init_process_group("gloo")
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    ref = make(os.path.join(root, "torch_dist", "iter_0000001"))
    dist_checkpointing.save(base(), ref, sharded_strategy=("torch_dist", 1))
    pec = quiet(root)
    reads_once(pec)
    cases: dict[str, tuple[Callable[[], dict], StrictHandling, bool]] = {}
    for width in (14, 18):  # global (2, 28) and (2, 36) where (2, 32) was saved
        for flexible in (False, True):
            cases[f"{'flexible' if flexible else 'rigid'} {width}"] = (
                functools.partial(shape_case, width, flexible),
                StrictHandling.ASSUME_OK_UNEXPECTED, True)
    for mode in StrictHandling:
        for what, build in (("unexpected", unexpected), ("missing", missing),
                            ("exact", base)):
            cases[f"{what} {mode.value}"] = (build, mode, True)
    cases["unexpected assume_ok no integrity"] = (unexpected,
                                                  StrictHandling.ASSUME_OK_UNEXPECTED, False)
    for case, (build, mode, integrity) in cases.items():
        stock = outcome(ref, build(), mode, integrity)
        ours = outcome(pec, build(), mode, integrity)
        compare(case, stock, ours)
        if case.startswith("rigid"):  # names the key and both global shapes
            width = int(case.split()[1])
            assert "'keyA'" in ours[3] and f"(2, {16 * WORLD})" in ours[3] \
                and f"(2, {width * WORLD})" in ours[3], ours[3]
        if case == "unexpected assume_ok_unexpected":
            assert "UnexpectedTenD" in ours[3] and "UnexpectedObjD" in ours[3], ours[3]
    fully_parallel(root, ref)
    switch(root, ref)
    sys.stdout.write(f"rank {RANK} STRICT OK {len(cases)}\n")
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
