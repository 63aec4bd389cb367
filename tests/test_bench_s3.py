"""The flat doors' benches restore from S3 by copying what the load needs to local disk
(moepec.bench.s3_root): the copy is byte for byte, and holds only what the load reads."""

import os
from pathlib import Path

import pytest

from moepec.bench import s3_root
from moepec.store.flat import FlatManifest, commit


def _tree(root: Path) -> None:
    """Folders a (old, needed by c's view), b (not needed), c (the head), d (a newer
    one, not loaded), and a root file (DeepSpeed's ``latest``)."""
    for n, name in enumerate("abcd"):
        for rel in ("moepec-r0/__0_0.distcp", "moepec-r0/.metadata", "common.pt"):
            path = root / name / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(os.urandom(1000 + 97 * n) + b"\0\xff")
        view = {"x": "a" if name == "c" else name, "y": name}
        commit(str(root), FlatManifest(name=name, seq=n, step=n, parent=None, items={},
                                       view=view, experts={}, experts_saved=[],
                                       k_persist=1, world_size=1))
    (root / "latest").write_text("c")


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in root.rglob("*") if p.is_file()}


def test_download_copies_the_head_and_the_folders_its_view_reads(tmp_path, s3_options):
    pytest.importorskip("moto.server")
    _tree(tmp_path / "local")
    url = "s3://moepec-test/bench-s3"
    s3_root.upload(s3_options, tmp_path / "local", url)
    got = s3_root.download(s3_options, url, "c", tmp_path / "copy")
    assert got == tmp_path / "copy" / "c"
    want = {k: v for k, v in _files(tmp_path / "local").items()
            if k == "latest" or k.split("/")[0] in ("a", "c")}
    assert _files(tmp_path / "copy") == want  # byte for byte, nothing else
    assert len(want) == 9


def test_choose_says_why():
    assert s3_root.choose(False) == (False, "off (--no-s3)")
    on, why = s3_root.choose(None)
    assert why.startswith("on" if on else "off")
