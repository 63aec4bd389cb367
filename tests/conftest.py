"""Shared fixtures for the model, data, trainer, CLI and storage tests."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.shm_cleanup import _no_shared_memory_left  # noqa: F401 (autouse)


@pytest.fixture
def text_files(tmp_path: Path) -> Path:
    """A directory of 200 small, distinct text files (a corpus for --data)."""
    root = tmp_path / "corpus"
    for i in range(200):
        sub = root / f"d{i % 7}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i:03d}.txt").write_text(f"file {i:03d}: " + "lorem ipsum dolor " * 20 + "\n")
    return root


@pytest.fixture(scope="session")
def s3_options():
    """fsspec options of a real S3-compatible server (moto's, over HTTP on loopback, port
    0) holding the bucket ``moepec-test``; skips without s3fs or moto."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    port = server._server.server_port
    opts = {"key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    import s3fs

    s3fs.S3FileSystem(**opts).mkdir("moepec-test")
    yield opts
    server.stop()


@pytest.fixture
def one_rank(tmp_path: Path):
    """A one-rank gloo process group for the test (the flat front end's collectives)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


# `make test` runs the suite on two pytest-xdist workers, one test file at a time per worker
# (`--dist loadfile`: a file's module fixtures, such as one torchrun launch shared by its
# tests, run once). A worker takes the next file in collection order when it is free
# (`--no-loadscope-reorder`: else xdist orders files by their number of tests), so
# the files that take longest go first (longest first: the two workers end close
# together, not one of them alone with the slowest end-to-end file). Ordered by their
# seconds in a serial run on this 2-core machine (`--durations`); files not named keep
# their order, after these.
LONGEST_FIRST = (
    "test_megatron.py", "test_ft.py", "test_demo.py", "test_deepspeed_hf.py",
    "test_planned_stop.py", "test_exit.py", "test_fsdp.py", "test_torchtitan.py",
    "test_megatron_ram.py", "test_deepspeed.py", "test_chaos.py", "test_fencing.py",
    "test_ram_torchrun.py", "test_deepspeed_ram.py", "test_lightning.py", "test_hf.py",
    "test_ft_hang.py",
    "test_report.py", "test_recovery.py", "test_fuzz.py", "test_striped.py",
    "test_torchtitan_door.py", "test_train.py", "test_ep.py", "test_spare.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable
