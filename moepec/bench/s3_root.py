"""Storage on S3 for the flat doors' restore benchmarks (``moepec bench megatron`` and
``moepec bench deepspeed``, ``--s3``).

Megatron-Core's ``dist_checkpointing`` and DeepSpeed write and load local paths only,
so a restarted worker of a cluster whose checkpoints sit in S3 first brings what its
load needs to local disk: the save directory's own files (DeepSpeed's ``latest``), the
newest folder, and the older sibling folders that folder's view reads from (its
manifest's :meth:`~moepec.store.flat.FlatManifest.needs`, read and validated from the
copy). :func:`download` is that step; the benchmark times it plus the framework's load
of the copy. The bucket is on moto's server over HTTP on loopback (an object store,
still on this host); :func:`upload` puts the committed folders there once, untimed.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from moepec.flat import read_manifest

BUCKET = "moepec-bench"


def add_flag(parser: argparse.ArgumentParser) -> None:
    """``--s3`` / ``--no-s3`` on a bench's parser (resolve it with :func:`choose`)."""
    parser.add_argument("--s3", action=argparse.BooleanOptionalAction, default=None,
                        help="also restore from S3 (moto's server on loopback: download "
                             "of the folders the load reads, then the load); default: on "
                             "when moto and s3fs import")


def choose(flag: bool | None) -> tuple[bool, str]:
    """Whether to measure S3 (``--s3``/``--no-s3``; default: on when moto's server and
    s3fs import), and the words that say why."""
    if flag is False:
        return False, "off (--no-s3)"
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as exc:
        if flag:
            raise SystemExit(f"--s3 needs moto[server] and s3fs ({exc}); "
                             f"pip install 'moto[server]' s3fs") from exc
        return False, f"off (moto or s3fs does not import: {exc.name})"
    return True, "on (--s3)" if flag else "on (moto and s3fs import)"


def start_moto(bucket: str = BUCKET) -> tuple[dict[str, Any], Any]:
    """moto's S3 server on a free loopback port holding ``bucket``: (fsspec options,
    the server; ``server.stop()`` when done)."""
    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    opts = {"key": "testing", "secret": "testing", "client_kwargs": {
        "endpoint_url": f"http://127.0.0.1:{server._server.server_port}"}}
    s3fs.S3FileSystem(**opts).mkdir(bucket)
    return opts, server


def _fs(opts: dict[str, Any]):
    import s3fs

    # a new client, no cached listing: what a restarted worker's process has
    return s3fs.S3FileSystem(**opts, skip_instance_cache=True)


def upload(opts: dict[str, Any], local_root: Path, url: str) -> None:
    """Put the save directory ``local_root`` (every file under it) at ``url``."""
    fs = _fs(opts)
    for path in sorted(p for p in local_root.rglob("*") if p.is_file()):
        fs.put_file(str(path), f"{url}/{path.relative_to(local_root).as_posix()}")


def _get_tree(fs, url: str, dest: Path) -> None:
    for remote in fs.find(url):
        local = dest / remote[len(url.removeprefix("s3://")) + 1:]
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(local))


def download(opts: dict[str, Any], url: str, head: str, dest: Path) -> Path:
    """Copy what a load of folder ``head`` of the save directory at ``url`` reads into
    the new local folder ``dest``: the directory's own files, ``head``, and the folders
    its manifest's view names. Returns ``dest / head``. Raises ManifestError or
    CheckpointError (from :func:`~moepec.flat.read_manifest`) when the copied
    head's manifest is damaged or missing."""
    fs = _fs(opts)
    dest.mkdir(parents=True)
    for entry in fs.ls(url, detail=True):
        if entry["type"] == "file":
            fs.get_file(entry["name"], str(dest / entry["name"].rsplit("/", 1)[1]))
    _get_tree(fs, f"{url}/{head}", dest / head)
    for name in read_manifest(str(dest), head).needs():
        _get_tree(fs, f"{url}/{name}", dest / name)
    return dest / head


class S3Copies:
    """A save directory put in a bucket on moto's server once (untimed), then copied
    back to a fresh local folder under ``work`` per restore (:meth:`fetch`, timed).
    ``close`` removes the copies and stops the server."""

    def __init__(self, local_root: Path, work: Path) -> None:
        self.opts, self._server = start_moto()
        self.url, self._work, self._n = f"s3://{BUCKET}/{local_root.name}", work, 0
        upload(self.opts, local_root, self.url)

    def fetch(self, head: str) -> tuple[Path, float]:
        """A new local copy of what a load of ``head`` reads: (its ``head`` folder, the
        seconds the download took). The previous copy is removed first (untimed)."""
        shutil.rmtree(self._work / f"s3-copy-{self._n}", ignore_errors=True)
        self._n += 1
        started = time.perf_counter()
        folder = download(self.opts, self.url, head, self._work / f"s3-copy-{self._n}")
        return folder, time.perf_counter() - started

    def close(self) -> None:
        shutil.rmtree(self._work / f"s3-copy-{self._n}", ignore_errors=True)
        self._server.stop()


def report_line(ram_s: float, s3_s: float | None, why: str) -> str:
    """The bench's S3 line: RAM / S3 against the goal, or why S3 was not measured."""
    if s3_s is None:
        return f"restore from S3: not measured (S3 {why})"
    return (f"restore from S3 (S3 {why}; moto on loopback: download of the folders the "
            f"load reads, then the load) {1e3 * s3_s:.1f} ms: RAM / S3 "
            f"{ram_s / s3_s:.3f}x (goal <= 0.5x)")
