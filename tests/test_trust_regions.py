"""Forged shard keys in a stranger's flat checkpoint, read by the flat front end: a load
at another parallel layout (FlatFrontEnd.load and read, the Megatron and DeepSpeed doors'
resharding, which cut the wanted box from the saved shards their keys place) and the
global shapes from the manifests (FlatFrontEnd.shapes, Megatron's
``load_tensors_metadata``). Each forgery is a CorruptCheckpointError naming the folder
and the key, raised before anything bigger than the stored items is allocated; never a
torch error, a wrong value or a tensor of a size the checkpoint does not hold.

The save is written with the store's own API, then its manifest's keys are renamed
(``items`` and ``view`` of moepec.json): the stored bytes stay as they were written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from moepec.errors import CorruptCheckpointError
from moepec.flat import FlatFrontEnd
from tests.test_trust_doors import committed

FOLDER = "iter_0000010"
W = torch.arange(16, dtype=torch.float32).reshape(4, 4)
V = torch.arange(100, 108, dtype=torch.float32)
SAVED = {"w#0,0+2,4": W[:2], "w#2,0+2,4": W[2:],  # two row blocks (like TP 2)
         "v#0+8~0:4": V[:4], "v#0+8~4:4": V[4:4], "v#0+8~4:8": V[4:]}  # flat slices
WANT = {"w": ("w#0,0+4,2", W[:, :2]),  # a column half: another layout than the save's
        "v": ("v#2+4", V[2:6])}  # a box across both flat slices
LIMIT = 1000
"""More values than any tensor of this save holds (nothing may allocate more)."""
BIG = 2**40


@pytest.fixture
def save(tmp_path: Path) -> Path:
    root = tmp_path / "save"
    committed(root, FOLDER, SAVED)
    return root


@pytest.fixture
def small_allocations(monkeypatch):
    """torch.empty and torch.zeros fail the test when asked for more than LIMIT values
    (before allocating): the read may allocate only what the checkpoint holds."""
    def guard(make):
        def sized(*args, **kwargs):
            dims = args[0] if len(args) == 1 and not isinstance(args[0], int) else args
            numel = math.prod(int(d) for d in dims)
            assert numel <= LIMIT, f"allocates a tensor of {numel} values"
            return make(*args, **kwargs)
        return sized
    monkeypatch.setattr(torch, "empty", guard(torch.empty))
    monkeypatch.setattr(torch, "zeros", guard(torch.zeros))


def forge(root: Path, renames: dict[str, str]) -> None:
    """Rename keys in the manifest's items and view, as a stranger could."""
    path = root / FOLDER / "moepec.json"
    data = json.loads(path.read_text())
    for old, new in renames.items():
        data["items"][new] = data["items"].pop(old)
        data["view"][new] = data["view"].pop(old)
    path.write_text(json.dumps(data))


def test_the_unforged_save_loads_at_another_layout(save, small_allocations):
    """The baseline the forgeries start from: bit for bit, and its shapes."""
    got, _ = FlatFrontEnd().load(str(save), FOLDER, [k for k, _ in WANT.values()])
    for key, expect in WANT.values():
        assert torch.equal(got[key], expect), key
    assert FlatFrontEnd().shapes(str(save), FOLDER) == {"w": ((4, 4), "float32"),
                                                        "v": ((8,), "float32")}


# What each did before the fix: a TypeError or RuntimeError from torch, a wrong value
# without an error, or an allocation of 4 TiB.
LOAD_FORGERIES = {
    "a row block ends past int64": ("w", {"w#2,0+2,4": f"w#2,0+{2**63},4"}),
    "a row block larger than its item": ("w", {"w#2,0+2,4": "w#2,0+3,4"}),
    "a row block of 2**40 rows": ("w", {"w#2,0+2,4": f"w#2,0+{BIG},4"}),
    "row blocks that overlap (and leave a gap)": ("w", {"w#2,0+2,4": "w#1,0+2,4"}),
    "a flat slice longer than its item": ("v", {"v#0+8~4:8": "v#0+8~3:8"}),
    "a reversed flat slice": ("v", {"v#0+8~4:8": "v#0+8~8:4"}),
    "a flat slice past its box": ("v", {"v#0+8~4:8": "v#0+8~8:12"}),
    "flat slices that overlap (and leave a gap)": ("v", {"v#0+8~4:8": "v#0+8~2:6"}),
    "flat slices of a box of 2**40 values": ("v", {"v#0+8~0:4": f"v#0+{BIG}~0:4",
                                                   "v#0+8~4:4": f"v#0+{BIG}~4:4",
                                                   "v#0+8~4:8": f"v#0+{BIG}~4:8"}),
}


@pytest.mark.parametrize("tensor, renames", LOAD_FORGERIES.values(), ids=LOAD_FORGERIES)
def test_a_forged_shard_key_fails_a_load_at_another_layout(save, small_allocations,
                                                           tensor, renames):
    forge(save, renames)
    want = WANT[tensor][0]
    with pytest.raises(CorruptCheckpointError) as exc:
        FlatFrontEnd().load(str(save), FOLDER, [want])
    message = str(exc.value)
    assert f"{save}/{FOLDER}" in message and "damaged" in message, message
    assert any(k.split("~")[0] in message for k in renames.values()), message
    with pytest.raises(CorruptCheckpointError):  # the doors' later reads of the folder
        FlatFrontEnd().read(str(save), FOLDER, [want])


def test_a_shard_read_as_saved_must_hold_what_its_key_says(save, small_allocations):
    """A load at the save's own layout reads the key as stored: a (2, 4) item under a
    key that says (3, 4) came back as (2, 4) (Megatron's door then failed in ``view``)."""
    forge(save, {"w#2,0+2,4": "w#2,0+3,4"})
    with pytest.raises(CorruptCheckpointError, match=r"'w#2,0\+3,4' holds 8 values"):
        FlatFrontEnd().read(str(save), FOLDER, ["w#0,0+2,4", "w#2,0+3,4"])


# Before the fix each gave a shape: past int64 (Megatron's metadata then failed making
# its meta tensor), of 2**40 rows (what load_plain_tensors then allocates), or one of
# fewer axes than a shard's.
SHAPE_FORGERIES = {
    "an offset past int64": {"w#2,0+2,4": f"w#{2**63},0+2,4"},
    "an offset of 2**40 rows": {"w#2,0+2,4": f"w#{BIG},0+2,4"},
    "a row block larger than its item": {"w#2,0+2,4": "w#2,0+3,4"},
    "shards with different numbers of axes": {"w#2,0+2,4": "w#2,0,0+2,4,1"},
    "flat slices of a box of 2**40 values": {"v#0+8~0:4": f"v#0+{BIG}~0:4",
                                             "v#0+8~4:4": f"v#0+{BIG}~4:4",
                                             "v#0+8~4:8": f"v#0+{BIG}~4:8"},
}


@pytest.mark.parametrize("renames", SHAPE_FORGERIES.values(), ids=SHAPE_FORGERIES)
def test_a_forged_shard_key_fails_the_global_shapes(save, renames):
    forge(save, renames)
    with pytest.raises(CorruptCheckpointError) as exc:
        FlatFrontEnd().shapes(str(save), FOLDER)
    message = str(exc.value)
    assert f"{save}/{FOLDER}" in message and "damaged" in message, message
    assert any(f"'{k.split('#')[0]}" in message for k in renames.values()), message


def test_shards_of_one_tensor_in_two_dtypes_are_refused(tmp_path, small_allocations):
    """Before the fix the float64 block was cast to float32 without a word."""
    root = tmp_path / "save"
    committed(root, FOLDER, SAVED | {"w#2,0+2,4": W[2:].double()})
    with pytest.raises(CorruptCheckpointError, match=f"{FOLDER}: .*'w'.* dtypes"):
        FlatFrontEnd().load(str(root), FOLDER, [WANT["w"][0]])
