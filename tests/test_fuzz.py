"""Seeded mutations of real checkpoints: restore, verify, inspect and export either
succeed with the values that were saved or fail with a MoepecError one-liner; nothing
runs code, nothing is written outside the root, nothing allocates more than the
checkpoint holds. The counts are printed and asserted."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from collections import Counter as Tally
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from moepec import CheckpointConfig, CheckpointManager
from moepec.errors import MoepecError
from moepec.recovery.offline import export_view, inspect_path, verify_path
from moepec.store.checksum import tensor_checksum
from tests import manifest_docs
from tests.toy import Counter, full_state, make, run_loop

CASES = int(os.environ.get("MOEPEC_FUZZ_CASES", "300"))
pytestmark = pytest.mark.slow


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz") / "template"
    # The checkpoints hold Python's and numpy's RNG states too: seeded, so the same
    # mutations land on the same bytes in every run.
    random.seed(0)
    np.random.seed(0)
    model, opt, sched = make(0, "stacked", 4)
    counter = Counter()
    cfg = CheckpointConfig(path=str(root), interval=2, k_persist=1, keep_last=8)
    mgr = CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter})
    saved = {}
    run_loop(mgr, model, opt, sched, counter, torch.Generator().manual_seed(1), 0, 8,
             on_save=lambda s: saved.__setitem__(s, full_state(model, opt)))
    mgr.close()
    return root, saved


# -- mutations ---------------------------------------------------------------------------
def _manifests(root: Path) -> list[Path]:
    return sorted(root.glob("ckpt-*/moepec.json"))


def _json_paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _json_paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node[:4]):
            yield from _json_paths(v, prefix + (i,))


_ODD = [None, "abc", -1, 10**15, 2.5, True, [], {}, [10**6, 10**6], "../../escape",
        "/etc/passwd", "float128", "ckpt-999999-step99999999", {"__tensor__": 1}]


def _mutate_json(rng: random.Random, root: Path, marker: str) -> str:
    path = rng.choice(_manifests(root))
    doc = json.loads(path.read_text())
    paths = [p for p in _json_paths(doc) if p]
    target = rng.choice(paths)
    parent = doc
    for k in target[:-1]:
        parent = parent[k]
    if rng.random() < 0.2 and isinstance(parent, dict):
        del parent[target[-1]]
        what = "delete"
    else:
        parent[target[-1]] = rng.choice(_ODD)
        what = "swap"
    path.write_text(json.dumps(doc))
    return f"manifest {what} {'/'.join(map(str, target[-3:]))}"


def _mutate_manifest_bytes(rng, root, marker):
    path = rng.choice(_manifests(root))
    data = bytearray(path.read_bytes())
    if rng.random() < 0.5:
        del data[rng.randrange(len(data)):]
        what = "truncate"
    else:
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        what = "flip"
    path.write_bytes(bytes(data))
    return f"manifest bytes {what}"


def _mutate_view(rng, root, marker):
    """A view file's bytes flipped or cut, or its JSON changed with the length and checksum
    the manifest records forged to match."""
    path = rng.choice(_manifests(root))
    doc = json.loads(path.read_text())
    ref = doc["view_file"]
    view_path = path.parent / ref["file"]
    data = bytearray(view_path.read_bytes())
    if rng.random() < 0.3:
        if rng.random() < 0.5:
            del data[rng.randrange(len(data)):]
        else:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        view_path.write_bytes(bytes(data))
        return "view bytes damaged"
    view = json.loads(data)
    key = rng.choice(sorted(view))
    r = rng.random()
    if r < 0.3:
        del view[key]
    elif r < 0.6:
        view[key] = rng.choice(sorted(set(view.values())))  # another real checkpoint
    else:
        view[rng.choice([key, "../../escape", "experts/0/9/model/x"])] = rng.choice(_ODD)
    blob = json.dumps(view).encode()
    view_path.write_bytes(blob)
    ref.update(length=len(blob), checksum="xxh3:" + xxhash.xxh3_64_hexdigest(blob))
    path.write_text(json.dumps(doc))
    return "view changed (checksum forged)"


def _mutate_metadata(rng, root, marker):
    folder = rng.choice(sorted(root.glob("ckpt-*")))
    payload = (pickle.dumps(_Payload(marker)) if rng.random() < 0.5
               else rng.randbytes(rng.randint(0, 64)))
    (folder / ".metadata").write_bytes(payload)
    return ".metadata replaced"


def _mutate_data(rng, root, marker):
    files = sorted(root.glob("ckpt-*/*.distcp"))
    path = rng.choice(files)
    data = bytearray(path.read_bytes())
    r = rng.random()
    if r < 0.3:
        del data[rng.randrange(len(data) + 1):]
        what = "truncate"
    elif r < 0.4:
        path.unlink()
        return "data file deleted"
    else:
        start = rng.randrange(len(data))
        for i in range(start, min(len(data), start + rng.randint(1, 64))):
            data[i] ^= 0xFF
        what = "flip"
    path.write_bytes(bytes(data))
    return f"data {what}"


def _mutate_object(rng, root, marker):
    """Junk or a pickle payload in an object item, with its checksum recomputed."""
    path = rng.choice(_manifests(root))
    doc, entries = manifest_docs.load(path)
    keys = [k for k in entries if k.startswith("objects/")]
    if not keys:
        return "no object item"
    item = entries[rng.choice(keys)]
    junk = pickle.dumps(_Payload(marker)) if rng.random() < 0.5 else rng.randbytes(64)
    data = junk[:item["length"]].ljust(item["length"], b"\0")
    blob = bytearray((path.parent / item["file"]).read_bytes())
    blob[item["offset"]:item["offset"] + len(data)] = data
    (path.parent / item["file"]).write_bytes(bytes(blob))
    item["checksum"] = tensor_checksum(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    manifest_docs.save(path, doc, entries)
    return "object item replaced (checksum forged)"


def _mutate_layout(rng, root, marker):
    folders = sorted(root.glob("ckpt-*"))
    r = rng.random()
    if r < 0.4:
        shutil.rmtree(rng.choice(folders))
        return "checkpoint deleted"
    if r < 0.7:
        (rng.choice(folders) / "moepec.json").unlink()
        return "manifest deleted"
    (root / "moepec.lease").write_bytes(rng.randbytes(32))
    return "lease garbage"


MUTATIONS = [_mutate_json, _mutate_json, _mutate_json, _mutate_manifest_bytes, _mutate_view,
             _mutate_metadata, _mutate_data, _mutate_data, _mutate_object, _mutate_layout]


# -- checking one case -------------------------------------------------------------------
def _restore_matches(root: Path, saved) -> str:
    model, opt, sched = make(7, "stacked", 4)
    counter = Counter()
    cfg = CheckpointConfig(path=str(root), interval=2, k_persist=1, keep_last=8)
    mgr = CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter})
    try:
        report = mgr.restore()
        if report is None:
            return "nothing"
        now = full_state(model, opt)
        base = saved[report.step]
        for key, value in now.items():
            if ".experts." in key and not key.endswith("/step"):
                for e in range(4):
                    layer = int(key.split(".")[1])
                    src = saved[report.sources[f"{layer}/{e}"]["step"]]
                    if key.startswith("model/") and not torch.equal(value[e], src[key][e]):
                        return f"WRONG {key}[{e}]"
            elif not torch.equal(value, base[key]):
                return f"WRONG {key}"
        return "ok"
    finally:
        mgr.close()


def _tools(root: Path, out: Path, saved) -> dict[str, str]:
    results = {}
    calls = {"restore": lambda: _restore_matches(root, saved),
             "verify": lambda: "ok" if verify_path(str(root)).ok else "not ok",
             "inspect": lambda: inspect_path(str(root)) and "ok",
             "export": lambda: export_view(str(root), str(out), "safetensors") and "ok"}
    for name, call in calls.items():
        try:
            results[name] = call()
        except MoepecError as exc:
            assert "\n" not in str(exc), f"{name}: a multi-line error: {exc}"
            results[name] = "refused"
    return results


def _guard_allocations(monkeypatch, limit: int) -> None:
    """Fail any tensor allocation larger than the checkpoint root's own bytes."""
    for fname in ("empty", "zeros"):
        real = getattr(torch, fname)

        def guarded(*shape, _real=real, **kw):
            t = _real(*shape, **kw)
            assert t.numel() * t.element_size() <= limit, f"allocated {t.shape}"
            return t

        monkeypatch.setattr(torch, fname, guarded)


def _listing(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


@pytest.mark.timeout(1800)  # fixed cases (300; MOEPEC_FUZZ_CASES=N for more): past 300 s when busy
def test_seeded_mutations_never_trace_back_run_code_escape_or_lie(template, tmp_path,
                                                                  monkeypatch):
    src, saved = template
    limit = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    _guard_allocations(monkeypatch, limit)
    marker = str(tmp_path / "pwned")
    tally: dict[str, Tally] = {t: Tally() for t in ("restore", "verify", "inspect", "export")}
    kinds = Tally()
    for case in range(CASES):
        rng = random.Random(case)
        sandbox = tmp_path / f"case{case % 4}"
        shutil.rmtree(sandbox, ignore_errors=True)
        root = sandbox / "ckpt"
        shutil.copytree(src, root)
        what = rng.choice(MUTATIONS)(rng, root, marker)
        kinds[what.split(" ")[0]] += 1
        outside = _listing(sandbox) - {str(p.relative_to(sandbox)) for p in [root]}
        outside = {p for p in outside if not p.startswith("ckpt")}
        res = _tools(root, sandbox / "out.safetensors", saved)
        for tool, outcome in res.items():
            tally[tool][outcome] += 1
        assert not os.path.exists(marker), f"case {case} ({what}) ran code"
        assert not res["restore"].startswith("WRONG"), f"case {case} ({what}): {res}"
        after = {p for p in _listing(sandbox) if not p.startswith("ckpt")}
        assert after - outside <= {"out.safetensors"}, f"case {case} ({what}) wrote {after}"
    print(f"\nfuzz: {CASES} cases, mutations {dict(kinds)}")
    for tool, counts in tally.items():
        print(f"fuzz: {tool}: {dict(counts)}")
    assert sum(tally["restore"].values()) == CASES
    assert tally["restore"]["ok"] > 0 and tally["restore"]["refused"] > 0
