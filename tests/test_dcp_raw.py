"""The raw-bytes DCP writer/reader pair, the save planner and the checksums."""

from __future__ import annotations

import uuid
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlan

from moepec import CheckpointConfig
from moepec.errors import CheckpointError, ConfigError
from moepec.store.checksum import checksum_matches, tensor_checksum
from moepec.store.dcp_planner import ROOT_KEY, KeySavePlanner
from moepec.store.dcp_raw import (
    RAW_DESCRIPTOR,
    RawFileSystemReader,
    RawFileSystemWriter,
    RawFsspecReader,
    RawFsspecWriter,
)
from moepec.store.items import Item
from moepec.store.persist import root_cause
from moepec.store.storage import Storage

# These tests call stock dcp.save / dcp.load themselves, in one process: torch's
# single-process notice is theirs (moepec's own calls stay quiet: the last test).
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 10, generator=g)
    return {
        "model/w": torch.randn(64, 48, generator=g),
        "model/bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "model/f16": torch.randn(5, 7, generator=g).to(torch.float16),
        "optim/step": torch.tensor(17.0),  # 0-d
        "objects/rng": torch.randint(0, 256, (1001,), dtype=torch.uint8, generator=g),
        "model/idx": torch.arange(-5, 300, dtype=torch.int64),
        "model/mask": torch.rand(19, generator=g) > 0.5,
        "model/empty": torch.empty(0, 4),
        "model/strided": wide[:, ::3],  # not contiguous
        "experts/0/1/model/moe.w1": torch.randn(3, 8, 8, generator=g)[1],
    }


def _targets(state):
    return {k: torch.full(v.shape, 7, dtype=v.dtype) if v.numel() else torch.empty_like(v)
            for k, v in state.items()}


def _equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().view(-1).view(torch.uint8),
                       b.contiguous().view(-1).view(torch.uint8))


def test_raw_round_trip_is_bit_exact_and_stores_only_tensor_bytes(tmp_path):
    state = _state()
    dcp.save(state, storage_writer=RawFileSystemWriter(str(tmp_path / "c")), no_dist=True)
    data = [p for p in (tmp_path / "c").iterdir() if p.name != ".metadata"]
    assert len(data) == 1  # one file per rank, items back to back
    assert data[0].stat().st_size == sum(t.numel() * t.element_size() for t in state.values())
    md = FileSystemReader(str(tmp_path / "c")).read_metadata()
    assert all(i.transform_descriptors == [RAW_DESCRIPTOR] for i in md.storage_data.values())

    got = _targets(state)
    dcp.load(got, storage_reader=RawFileSystemReader(str(tmp_path / "c")), no_dist=True)
    for k in state:
        assert _equal_bits(got[k], state[k]), k

    # a subset, into a non-contiguous target of a larger buffer
    holder = torch.zeros(64, 96)
    part = {"model/w": holder[:, ::2]}
    dcp.load(part, storage_reader=RawFileSystemReader(str(tmp_path / "c")), no_dist=True)
    assert torch.equal(holder[:, ::2], state["model/w"])
    assert not holder[:, 1::2].any()


def test_stock_reader_refuses_raw_items_by_name(tmp_path):
    state = {"a": torch.ones(3)}
    dcp.save(state, storage_writer=RawFileSystemWriter(str(tmp_path / "c")), no_dist=True)
    with pytest.raises(CheckpointException) as err:
        dcp.load({"a": torch.zeros(3)}, storage_reader=FileSystemReader(str(tmp_path / "c")),
                 no_dist=True)
    assert "moepec.raw" in str(root_cause(err.value))


def test_raw_reader_reads_stock_dcp(tmp_path):
    state = _state()
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "c")), no_dist=True)
    got = _targets(state)
    dcp.load(got, storage_reader=RawFileSystemReader(str(tmp_path / "c")), no_dist=True)
    for k in state:
        assert _equal_bits(got[k], state[k]), k


def test_raw_over_fsspec_memory(tmp_path):
    url = f"memory://raw-{uuid.uuid4().hex}"
    state = _state()
    dcp.save(state, storage_writer=RawFsspecWriter(url, sync_files=False), no_dist=True)
    got = _targets(state)
    dcp.load(got, storage_reader=RawFsspecReader(url), no_dist=True)
    for k in state:
        assert _equal_bits(got[k], state[k]), k


def test_truncated_file_is_an_error_not_garbage(tmp_path):
    state = {"a": torch.arange(1000, dtype=torch.float32)}
    dcp.save(state, storage_writer=RawFileSystemWriter(str(tmp_path / "c")), no_dist=True)
    data = next(p for p in (tmp_path / "c").iterdir() if p.name != ".metadata")
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(CheckpointException) as err:
        dcp.load({"a": torch.zeros(1000)}, storage_reader=RawFileSystemReader(str(tmp_path / "c")),
                 no_dist=True)
    cause = root_cause(err.value)
    assert isinstance(cause, OSError) and "truncated" in str(cause)


@pytest.mark.parametrize("serialization", ["raw", "torch_save"])
def test_storage_serializations(tmp_path, serialization):
    st = Storage(str(tmp_path), serialization=serialization)
    state = _state()
    where = st.write("ckpt-000000-step00000000-0123456789ab", {k: v.contiguous() for k, v in state.items()})
    # moepec reads by the locations the write reported (the manifest records them)
    items = {k: Item(shape=list(v.shape), dtype=str(v.dtype).removeprefix("torch."),
                     nbytes=v.numel() * v.element_size(), file=where[k].file,
                     offset=where[k].offset, length=where[k].length,
                     encoding=where[k].encoding) for k, v in state.items()}
    assert {loc.encoding for loc in where.values()} == {serialization}
    got = _targets(state)
    st.read("ckpt-000000-step00000000-0123456789ab", got, items)
    for k in state:
        assert _equal_bits(got[k], state[k]), k
    if serialization == "torch_save":  # stock DCP: any FileSystemReader loads it
        plain = _targets(state)
        dcp.load(plain, storage_reader=FileSystemReader(str(tmp_path / "ckpt-000000-step00000000-0123456789ab")),
                 no_dist=True)
        assert all(_equal_bits(plain[k], state[k]) for k in state)


def test_bad_serialization_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="serialization"):
        CheckpointConfig(path="x", serialization="pickle")
    with pytest.raises(CheckpointError, match="serialization"):
        Storage(str(tmp_path), serialization="pickle")


def _plan_of(state) -> SavePlan:
    planner = KeySavePlanner()
    planner.set_up_planner({ROOT_KEY: state}, is_coordinator=True)
    return planner.create_local_plan()


def test_planner_refuses_a_key_written_by_two_ranks():
    a = _plan_of({"k": torch.ones(2)})
    b = _plan_of({"k": torch.ones(2)})
    with pytest.raises(AssertionError):
        KeySavePlanner().create_global_plan([a, b])
    plans, md = KeySavePlanner().create_global_plan([a, _plan_of({"j": torch.ones(3)})])
    assert set(md.state_dict_metadata) == {"k", "j"} and len(plans) == 2


def test_checksums_one_algorithm():
    import xxhash

    t = torch.randn(100)
    new = tensor_checksum(t)
    assert new.startswith("xxh3:") and checksum_matches(t, new)
    h = xxhash.xxh64(str((t.dtype, tuple(t.shape))).encode())
    h.update(t.numpy().tobytes())
    assert not checksum_matches(t, f"xxh64:{h.hexdigest()}")  # pre-release: not verified
    flipped = t.clone()
    flipped.view(torch.int32)[50] ^= 1
    assert not checksum_matches(flipped, new)
    assert not checksum_matches(t, None) and not checksum_matches(t, "md5:" + new[5:])
    # shape and dtype are part of it
    assert tensor_checksum(t.view(10, 10)) != new


@pytest.mark.parametrize("serialization", ["raw", "torch_save"])
def test_chunk_keys_are_written_as_dcp_shards(tmp_path, serialization):
    """Chunk keys become SHARD items of their base tensor: .metadata lists the tensor once
    with all its chunks; moepec reads each chunk key at the location the write reported;
    a DCP reader loads the whole tensor. Chunks that do not tile their tensor fail."""
    g = torch.Generator().manual_seed(1)
    w, e = torch.randn(5, 4, generator=g), torch.randn(3, 6, generator=g)
    state = {"model/w#0,0+3,4:5,4": w[:3].clone(), "model/w#3,0+2,4:5,4": w[3:].clone(),
             "experts/0/2/model/e#0,0+3,4:3,6": e[:, :4].clone(),
             "experts/0/2/model/e#0,4+3,2:3,6": e[:, 4:].clone(),
             "optim/w/step": torch.tensor(3.0)}
    st = Storage(str(tmp_path), serialization=serialization)
    name = "ckpt-000000-step00000000-0123456789ab"
    where = st.write(name, state)
    assert set(where) == set(state)
    md = FileSystemReader(str(tmp_path / name)).read_metadata()
    assert set(md.state_dict_metadata) == {"model/w", "experts/0/2/model/e", "optim/w/step"}
    chunks = md.state_dict_metadata["model/w"].chunks
    assert md.state_dict_metadata["model/w"].size == w.shape
    assert sorted((list(c.offsets), list(c.sizes)) for c in chunks) == [
        ([0, 0], [3, 4]), ([3, 0], [2, 4])]
    items = {k: Item(shape=list(v.shape), dtype="float32", nbytes=v.numel() * 4,
                     file=where[k].file, offset=where[k].offset, length=where[k].length,
                     encoding=where[k].encoding) for k, v in state.items()}
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    st.read(name, got, items)
    assert all(torch.equal(got[k], state[k]) for k in state)
    reader = (RawFileSystemReader if serialization == "raw" else FileSystemReader)(
        str(tmp_path / name))
    whole = {"model/w": torch.zeros(5, 4), "experts/0/2/model/e": torch.zeros(3, 6)}
    dcp.load(whole, storage_reader=reader, no_dist=True)
    assert torch.equal(whole["model/w"], w) and torch.equal(whole["experts/0/2/model/e"], e)
    for bad in ({"model/w#0,0+3,4:5,4": w[:3]},  # a gap
                {"model/w#0,0+3,4:5,4": w[:3], "model/w#2,0+3,4:5,4": w[2:]}):  # overlap
        with pytest.raises((CheckpointException, CheckpointError)) as err:  # (DCP wraps)
            Storage(str(tmp_path / "bad"), serialization=serialization).write(name, bad)
        cause = root_cause(err.value)
        assert isinstance(cause, CheckpointError) and "do not tile" in str(cause)


def test_conjugate_views_and_fsspec_default_sync(tmp_path):
    c = torch.randn(5, dtype=torch.complex64)
    state = {"c": c.conj(), "n": torch._neg_view(torch.randn(3))}
    url = f"memory://raw-{uuid.uuid4().hex}"
    dcp.save(state, storage_writer=RawFsspecWriter(url), no_dist=True)  # sync_files default
    got = {"c": torch.zeros(5, dtype=torch.complex64), "n": torch.zeros(3)}
    dcp.load(got, storage_reader=RawFsspecReader(url), no_dist=True)
    assert torch.equal(got["c"], c.conj().resolve_conj())
    assert torch.equal(got["n"], state["n"].resolve_neg())
    conj_target = {"c": torch.zeros(5, dtype=torch.complex64).conj()}
    dcp.load(conj_target, storage_reader=RawFsspecReader(url), no_dist=True)
    assert torch.equal(conj_target["c"].resolve_conj(), c.conj().resolve_conj())


def test_checksum_of_wrong_type_is_a_mismatch_not_a_crash():
    t = torch.ones(3)
    assert not checksum_matches(t, 5) and not checksum_matches(t, {"xxh3": "x"})


@pytest.mark.parametrize("async_persist", [False, True])
def test_one_process_save_restore_and_export_warn_nothing(tmp_path, async_persist):
    """No stray warnings from our own DCP calls (torch warns at every one-process save)."""
    from moepec import CheckpointManager
    from moepec.recovery.offline import export_view
    from tests.toy import Counter, make, run_loop

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (0, 1):  # a run, then a second one that restores it
            model, opt, sched = make(seed, "stacked", 4)
            counter = Counter()
            cfg = CheckpointConfig(path=str(tmp_path / "c"), interval=2, k_persist=1,
                                   async_persist=async_persist)
            mgr = CheckpointManager(model, opt, cfg, extra_state={"sched": sched,
                                                                  "data": counter})
            report = mgr.restore()
            start = report.step + 1 if report else 0
            run_loop(mgr, model, opt, sched, counter, torch.Generator().manual_seed(seed),
                     start, 4)
            mgr.close()
        export_view(str(tmp_path / "c"), str(tmp_path / "out"), "dcp")
    assert report is not None and report.step == 3
    assert [str(w.message) for w in caught] == []


def test_own_one_process_dcp_calls_leave_no_trace_records_others_still_do(tmp_path):
    """DCP's method logger (DEBUG, propagating nowhere; pytest's caplog attaches to it)
    gets no record of a save inside ``single_process_dcp`` (Megatron's tests assert an
    empty capture around a save), while a save of another thread at the same time is
    traced as before, and so is this thread's once it has left."""
    import logging
    import threading

    from torch.distributed.checkpoint.logger import _dcp_logger

    from moepec.store.storage import single_process_dcp

    heard: list[int] = []

    class Heard(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            heard.append(record.thread)

    def save(name: str) -> None:
        dcp.save({"x": torch.zeros(2)}, checkpoint_id=str(tmp_path / name), no_dist=True)

    me, theirs, inside = threading.get_ident(), [], threading.Event()

    def other() -> None:
        inside.wait(60)
        theirs.append(threading.get_ident())
        save("theirs")

    handler = Heard()
    _dcp_logger.addHandler(handler)
    try:
        thread = threading.Thread(target=other)
        thread.start()
        with single_process_dcp():
            with single_process_dcp():  # a nested use leaves the outer one in force
                pass
            inside.set()
            save("ours")
            thread.join(60)
        ours_inside = heard.count(me)
        save("after")
    finally:
        _dcp_logger.removeHandler(handler)
    assert not thread.is_alive() and theirs
    assert ours_inside == 0, heard
    assert heard.count(theirs[0]) > 0 and heard.count(me) > 0, heard


def test_write_all_goes_on_after_short_writes(tmp_path, monkeypatch):
    """writev may write less than asked (and at most IOV_MAX buffers at a time): the
    file still holds every buffer (bytes, or a tensor's), whole and in order."""
    import os

    from moepec.store import dcp_raw

    real = os.writev
    monkeypatch.setattr(dcp_raw, "IOV_MAX", 3)
    # at most 7 bytes per call: a prefix of what was asked, as a short write is
    monkeypatch.setattr(dcp_raw.os, "writev", lambda fd, bufs: real(
        fd, [b"".join(bytes(b) for b in bufs)[:7]]))
    tensors = [torch.arange(i, dtype=torch.int16) for i in range(5)]  # kept alive
    bufs = ([memoryview(bytes([i]) * (i * 3)) for i in range(9)]
            + [dcp_raw._bytes_of(t) for t in tensors])  # ctypes arrays over tensors
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        dcp_raw.write_all(fd, list(bufs))
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(bytes(b) for b in bufs)


def _started_save(writer, state):
    """moepec's own raw save of ``state`` by one process: the data file's write started,
    .metadata from its items (what Storage.write does; the caller then waits)."""
    from moepec.store.dcp_planner import StartedIndex

    return StartedIndex().save(writer, state, None, False)


def test_a_started_write_is_waited_for_and_its_fsync_error_raised(tmp_path, monkeypatch):
    """start(): the save returns while the data file's write and fsync may still run;
    wait_synced joins them, and a failed fsync is raised there (the data is not durable)."""
    from moepec.store import dcp_raw

    state = _state()
    writer = RawFileSystemWriter(str(tmp_path / "c"))
    _started_save(writer, state)
    writer.wait_synced()
    reader_targets = _targets(state)
    dcp.load(reader_targets, storage_reader=RawFileSystemReader(str(tmp_path / "c")))
    assert all(_equal_bits(reader_targets[k], state[k]) for k in state)

    def failing_fsync(fd):
        raise OSError(5, "fsync failed")

    monkeypatch.setattr(dcp_raw.os, "fsync", failing_fsync)
    writer = RawFileSystemWriter(str(tmp_path / "d"), sync_files=True)
    monkeypatch.setattr(writer, "finish", lambda *a, **k: None)  # .metadata: not fsync'd here
    _started_save(writer, state)
    with pytest.raises(OSError, match="fsync failed"):
        writer.wait_synced()


def _local_write(tmp_path, name, state):
    from moepec.store.storage.local import LocalStorage

    return LocalStorage(str(tmp_path)).write(name, state)


def test_a_started_write_stores_the_same_file_as_dcp_would_and_reads_back_bit_exact(
        tmp_path, monkeypatch):
    """Storage.write on a local root starts the data file's write at once
    (RawFileSystemWriter.start): the file is the one DCP's own raw write would store
    (same name, same bytes), no temporary name is left, and a stock dcp.load with the
    raw reader reads every tensor back bit for bit."""
    state = _state()
    started = []
    start = RawFileSystemWriter.start
    monkeypatch.setattr(RawFileSystemWriter, "start",
                        lambda self, t, r: (started.append((len(t), r)), start(self, t, r)))
    where = _local_write(tmp_path, "c", state)
    assert started == [(len(state), 0)]
    dcp.save({ROOT_KEY: dict(state)}, planner=KeySavePlanner(), no_dist=True,
             storage_writer=RawFileSystemWriter(str(tmp_path / "stock"), sync_files=True))
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [".metadata", "__0_0.distcp"]
    assert ((tmp_path / "c" / "__0_0.distcp").read_bytes()
            == (tmp_path / "stock" / "__0_0.distcp").read_bytes())
    assert {loc.file for loc in where.values()} == {"__0_0.distcp"}
    targets = _targets(state)
    dcp.load(targets, storage_reader=RawFileSystemReader(str(tmp_path / "c")), no_dist=True)
    assert all(_equal_bits(targets[k], state[k]) for k in state)
    # A dcp.save through a started writer would write the data a second time: refused.
    writer = RawFileSystemWriter(str(tmp_path / "e"), sync_files=True)
    writer.start(state, 0)
    with pytest.raises(CheckpointException, match="indexed by moepec"):
        dcp.save({ROOT_KEY: dict(state)}, planner=KeySavePlanner(), no_dist=True,
                 storage_writer=writer)
    writer.wait_synced()
    assert ((tmp_path / "e" / "__0_0.distcp").read_bytes()
            == (tmp_path / "stock" / "__0_0.distcp").read_bytes())


def test_a_started_write_is_joined_when_the_save_fails_and_its_own_error_raised(
        tmp_path, monkeypatch):
    """A save that fails after the write started (here: building its .metadata) raises
    its own error, and the writing thread has ended before Storage.write returns (it
    reads the caller's tensors); a failed write of the data itself is raised by
    Storage.write."""
    import threading
    import time

    from moepec.store import dcp_raw
    from moepec.store.dcp_planner import StartedIndex

    def bad_index(self, entries):
        raise CheckpointError("index failed")

    write_all = dcp_raw.write_all

    def slow_write(fd, bufs):  # still writing when the index fails
        time.sleep(0.3)
        write_all(fd, bufs)

    with monkeypatch.context() as m:
        m.setattr(StartedIndex, "build", bad_index)
        m.setattr(dcp_raw, "write_all", slow_write)
        with pytest.raises(CheckpointError, match="index failed"):
            _local_write(tmp_path, "c", _state())
    assert not [t for t in threading.enumerate() if t.name == "moepec-data-write"]
    assert not (tmp_path / "c" / ".metadata").exists()

    def full_disk(fd, bufs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp_raw, "write_all", full_disk)
    with pytest.raises(OSError, match="No space left"):
        _local_write(tmp_path, "d", _state())


def test_a_started_writes_metadata_is_fsynced_after_the_data_and_before_wait_synced_returns(
        tmp_path, monkeypatch):
    """After start(), DCP's finish writes .metadata without its own fsync (that fsync
    waited for the data file's and held up the persist's work beside it); wait_synced
    fsyncs .metadata and then its folder, after the data file's, and raises a failed
    fsync of .metadata (nothing of the save may then be committed)."""
    import os

    from moepec.store import atomic, dcp_raw

    state, synced = _state(), []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(dcp_raw.os, "fsync", recording_fsync)
    monkeypatch.setattr(atomic.os, "fsync", recording_fsync)
    writer = RawFileSystemWriter(str(tmp_path / "c"), sync_files=True)
    _started_save(writer, state)
    assert ".metadata" not in synced and ".metadata.tmp" not in synced
    writer.wait_synced()
    assert synced == ["__0_0.distcp", ".metadata", "c"]
    targets = _targets(state)
    dcp.load(targets, storage_reader=RawFileSystemReader(str(tmp_path / "c")), no_dist=True)
    assert all(_equal_bits(targets[k], state[k]) for k in state)

    def metadata_fails(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".metadata"):
            raise OSError(5, "fsync of .metadata failed")
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", metadata_fails)
    writer = RawFileSystemWriter(str(tmp_path / "d"), sync_files=True)
    _started_save(writer, state)
    with pytest.raises(OSError, match="fsync of .metadata failed"):
        writer.wait_synced()


def test_a_started_writes_metadata_is_written_after_the_datas_writev(tmp_path, monkeypatch):
    """DCP's .metadata (a small file) is written only once the data file's writev has
    returned, never beside it (a small write during a large one stalled the large one
    8-20x here); the save is unchanged and reads back bit for bit."""
    import time

    from moepec.store import dcp_raw

    events: list[tuple[str, float]] = []
    real_write_all, real_finish = dcp_raw.write_all, FileSystemWriter.finish

    def slow_write_all(fd, bufs):
        time.sleep(0.3)  # the index is built meanwhile, and would write .metadata now
        real_write_all(fd, bufs)
        events.append(("writev returned", time.perf_counter()))

    def finish(self, metadata, results):
        events.append(("metadata written", time.perf_counter()))
        real_finish(self, metadata, results)

    monkeypatch.setattr(dcp_raw, "write_all", slow_write_all)
    monkeypatch.setattr(FileSystemWriter, "finish", finish)
    state = _state()
    writer = RawFileSystemWriter(str(tmp_path / "c"), sync_files=True)
    _started_save(writer, state)
    writer.wait_synced()
    assert [name for name, _ in events] == ["writev returned", "metadata written"]
    targets = _targets(state)
    dcp.load(targets, storage_reader=RawFileSystemReader(str(tmp_path / "c")), no_dist=True)
    assert all(_equal_bits(targets[k], state[k]) for k in state)


def _metadata_of(reader) -> tuple:
    md = reader.read_metadata()
    return md.state_dict_metadata, md.storage_data, md.planner_data, md.version


@pytest.mark.parametrize("remote", [False, True], ids=["local", "fsspec"])
def test_a_raw_roots_metadata_is_the_one_dcp_save_writes_for_the_same_tensors(
        tmp_path, remote):
    """Storage.write with raw serialization builds .metadata from the items it wrote,
    without DCP's plans (StartedIndex), on a local root and an fsspec one alike: the
    tensors, their chunks and every item's location are those a dcp.save with moepec's
    planner and raw writer records for the same tensors, save after save (a whole
    tensor's entry is kept between saves, rebuilt when its shape or dtype changes); the
    pickle holds nothing but DCP's own classes, and DCP loads it bit for bit."""
    import pickletools

    state = _state()
    g = torch.Generator().manual_seed(3)
    w = torch.randn(5, 4, generator=g)
    state.update({"model/w2#0,0+3,4:5,4": w[:3].clone(), "model/w2#3,0+2,4:5,4": w[3:].clone()})
    root = f"memory://started-{uuid.uuid4().hex}" if remote else str(tmp_path / "root")
    st = Storage(root)
    reader = RawFsspecReader if remote else RawFileSystemReader
    for i, change in enumerate([{}, {}, {"model/w": torch.randn(3, 2, dtype=torch.float64)}]):
        state.update(change)
        st.write(f"c{i}", state)
        dcp.save({ROOT_KEY: dict(state)}, planner=KeySavePlanner(), no_dist=True,
                 storage_writer=RawFileSystemWriter(str(tmp_path / f"dcp{i}")))
        assert (_metadata_of(reader(f"{root}/c{i}"))
                == _metadata_of(FileSystemReader(str(tmp_path / f"dcp{i}"))))
        with st.fs.open(f"{st.root}/c{i}/.metadata", "rb") as f:
            ops = {op.name for op, *_ in pickletools.genops(f.read())}
        assert "REDUCE" in ops or "NEWOBJ" in ops  # (a class pickle, read by DCP's reader)
        whole = {k: v for k, v in state.items() if "#" not in k}
        targets = {**_targets(whole), "model/w2": torch.zeros(5, 4)}
        dcp.load(targets, storage_reader=reader(f"{root}/c{i}"), no_dist=True)
        assert all(_equal_bits(targets[k], whole[k]) for k in whole)
        assert _equal_bits(targets["model/w2"], w)


def test_the_started_index_of_several_ranks_is_dcps_global_plans(tmp_path):
    """Several ranks' items (whole tensors and the chunks of one tensor from two ranks):
    the tensors StartedIndex records are those DCP's global plan makes of the same
    ranks' plans, each rank's items in its own file; a tensor written by two ranks,
    whole and in chunks, or in chunks of two shapes or dtypes, is refused by name."""
    from moepec.store.dcp_planner import StartedIndex

    g = torch.Generator().manual_seed(4)
    w = torch.randn(6, 3, generator=g)
    ranks = [{"a": torch.randn(4, generator=g), "w#0,0+2,3:6,3": w[:2].clone()},
             {"b": torch.ones(2, 2, dtype=torch.int32), "w#2,0+4,3:6,3": w[2:].clone()}]

    def entries(state):
        out, offset = [], 0
        for k, t in state.items():
            out.append((k, t.shape, t.dtype, offset, t.nbytes))
            offset += t.nbytes
        return out

    metadata, results = StartedIndex().build([entries(s) for s in ranks])
    _, expected = KeySavePlanner().create_global_plan([_plan_of(s) for s in ranks])
    assert metadata.state_dict_metadata == expected.state_dict_metadata
    assert [[(r.index.fqn, list(r.index.offset), r.storage_data.relative_path,
              r.storage_data.offset, r.size_in_bytes) for r in rs] for rs in results] == [
        [("a", [0], "__0_0.distcp", 0, 16), ("w", [0, 0], "__0_0.distcp", 16, 24)],
        [("b", [0, 0], "__1_0.distcp", 0, 16), ("w", [2, 0], "__1_0.distcp", 16, 48)]]
    for bad, why in [([{"a": torch.ones(4)}, {"a": torch.ones(4)}], "a is written twice"),
                     ([{"w": torch.ones(6, 3)}, {"w#2,0+4,3:6,3": w[2:]}], "whole and in"),
                     ([{"w#0,0+2,3:6,3": w[:2]}, {"w#2,0+4,3:6,3": w[2:].double()}],
                      "disagree"),
                     ([{"w#0,0+2,3:6,3": w[:2]}, {"w#1,0+4,3:6,3": w[1:5]}], "do not tile")]:
        with pytest.raises(CheckpointError, match=why):
            StartedIndex().build([entries(s) for s in bad])
