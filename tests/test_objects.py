"""Small objects as tagged JSON: exact round trips, strict decoding that runs no code,
unstorable values refused at save time, RNG and optimizer hyper-parameters restored."""

from __future__ import annotations

import ast
import base64
import io
import json
import math
import pickle
import random
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moepec.errors import CheckpointError, ConfigError, CorruptCheckpointError
from moepec.state.catalog import StateCatalog
from moepec.state.experts import discover
from moepec.state.objects import (
    FORMAT,
    MAX_DEPTH,
    NDARRAY_DTYPES,
    TENSOR_DTYPES,
    decode_object,
    encode_object,
)
from moepec.state.rng import check_rng_state, rng_state, set_rng_state
from moepec.train.data import TokenLoader
from tests.toy import Counter, make

KEY = "objects/extra/data"


def roundtrip(obj):
    return decode_object(encode_object(obj, "obj"), KEY)


def same(a, b) -> bool:
    """Equal values of equal types all the way down (nan equals nan, -0.0 is not 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):  # a nan's sign and payload are not kept; -0.0's sign is
        return a != a and b != b or a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.shape) == (b.dtype, b.shape) and a.device.type == "cpu" and \
            _bytes(a) == _bytes(b)
    if isinstance(a, np.ndarray | np.generic):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)  # order kept
    return a == b


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def raw_doc(value) -> torch.Tensor:
    """A hand-made document (bypassing the encoder) as stored bytes."""
    data = json.dumps({"format": FORMAT, "value": value}).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


# -- round trips ---------------------------------------------------------------------------
EDGE_CASES = [
    None, True, False, 0, -1, 2**100, -(2**64), 1.5, -0.0, 5e-324, 1.7976931348623157e308,
    math.nan, math.inf, -math.inf, "", "é ☃ 𝄞", "\ud800 lone surrogate", "line\nbreak",
    "__tuple__", (), [], {}, (1, (2, (3,))), [(), [()]], (None, True, 1, 1.0, "1"),
    {"a": 1, "b": [1, 2]}, {0: "a", 1: "b"}, {1: "x", "1": "y", None: 0, False: 2, 2.5: 3},
    {(0, "a"): 1}, {"__tuple__": [1]}, {"__dict__": 1, "plain": 2}, {"__x__": None},
    {"nan": {math.nan: 1}}, [[[[[]]]]],
    {"betas": (0.9, 0.999), "lr": 1e-3, "foreach": None, "amsgrad": False},
]


@pytest.mark.parametrize("obj", EDGE_CASES, ids=range(len(EDGE_CASES)))
def test_plain_values_round_trip_exactly(obj):
    back = roundtrip(obj)
    assert same(back, obj), (obj, back)


@pytest.mark.parametrize("name", sorted(TENSOR_DTYPES))
def test_tensors_of_every_allowed_dtype_round_trip(name):
    dtype = TENSOR_DTYPES[name]
    base = torch.tensor([[0, 1, 0], [1, 1, 0]]) if dtype == torch.bool else \
        torch.arange(-3, 3).reshape(2, 3)
    t = base.to(dtype)
    for case in (t, t.t(), t[:, 1], t[0, 0], t[:0], t.reshape(1, 2, 1, 3)):
        assert same(roundtrip(case), case.contiguous())
    if dtype.is_floating_point:
        special = torch.tensor([math.nan, math.inf, -math.inf, -0.0]).to(dtype)
        assert same(roundtrip(special), special)


@pytest.mark.parametrize("name", sorted(NDARRAY_DTYPES))
def test_arrays_and_numpy_scalars_round_trip(name):
    dtype = NDARRAY_DTYPES[name]
    a = (np.arange(12) % 2).astype(dtype).reshape(3, 4)
    for case in (a, a.T, a[:, ::2], np.asarray(a[0, 0]), a[:0]):
        assert same(roundtrip(case), np.array(case, order="C"))
    assert same(roundtrip(a[1, 1]), a[1, 1])  # a numpy scalar stays a numpy scalar
    big_endian = a.astype(dtype.newbyteorder(">"))
    back = roundtrip(big_endian)
    assert back.dtype == dtype and np.array_equal(back, a)


def test_containers_of_other_kinds_come_back_plain():
    ordered = OrderedDict([("b", torch.ones(2)), ("a", 1)])
    assert same(roundtrip(ordered), {"b": torch.ones(2), "a": 1})
    assert same(roundtrip(torch.Size([2, 3])), (2, 3))
    assert same(roundtrip(torch.nn.Parameter(torch.ones(2))), torch.ones(2))
    assert same(roundtrip(np.float64(0.25)), np.float64(0.25))


def test_opaque_bytes_and_sets_round_trip_without_unpickling():
    # Transformer Engine's _extra_state: an io.BytesIO of torch.save'd bytes, handed back
    # as it came (moepec never reads what is inside)
    buf = io.BytesIO()
    torch.save({"scale": torch.ones(2)}, buf)
    buf.seek(3)
    obj = {"te": buf, "raw": b"\x80\x04K\x01.", "s": {3, "a", (1, 2)},
           "f": frozenset({None, 2.5})}
    back = decode_object(encode_object(obj, "obj"), "obj")
    assert isinstance(back["te"], io.BytesIO) and back["te"].tell() == 0
    assert back["te"].getvalue() == buf.getvalue()
    assert back["raw"] == obj["raw"] and back["s"] == obj["s"] and back["f"] == obj["f"]
    assert type(back["s"]) is set and type(back["f"]) is frozenset
    # the same set in another insertion order encodes to the same bytes
    assert torch.equal(encode_object({3, "a", (1, 2)}, "x"),
                       encode_object({(1, 2), "a", 3}, "x"))
    bad = b'{"format":"moepec-object/1","value":{"__set__":[1,1]}}'
    with pytest.raises(CorruptCheckpointError, match="repeated"):
        decode_object(torch.frombuffer(bytearray(bad), dtype=torch.uint8), "x")


def test_encoding_is_deterministic_strict_ascii_json():
    obj = {"x": [math.nan, (1, 2)], 3: torch.arange(4), "s": "é"}
    a, b = encode_object(obj, "obj"), encode_object(obj, "obj")
    assert torch.equal(a, b) and a.dtype == torch.uint8 and a.dim() == 1
    text = a.numpy().tobytes().decode("ascii")
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))


_scalars = (st.none() | st.booleans() | st.integers() | st.text(max_size=8)
            | st.floats(allow_nan=True, allow_infinity=True))
_keys = (st.text(max_size=6) | st.sampled_from(["__tuple__", "__dict__", "__x__", "_"])
         | st.integers(-5, 5) | st.tuples(st.integers(0, 3), st.text(max_size=2)))
_tensors = st.builds(lambda vals, name: torch.tensor(vals).to(TENSOR_DTYPES[name]),
                     st.lists(st.integers(-100, 100), max_size=6),
                     st.sampled_from(sorted(TENSOR_DTYPES)))
_arrays = st.builds(lambda vals, name: np.array(vals).astype(NDARRAY_DTYPES[name]),
                    st.lists(st.integers(0, 100), max_size=6),
                    st.sampled_from(sorted(NDARRAY_DTYPES)))
_values = st.recursive(
    _scalars | _tensors | _arrays,
    lambda inner: (st.lists(inner, max_size=4) | st.tuples(inner, inner)
                   | st.dictionaries(st.text(max_size=6), inner, max_size=4)
                   | st.dictionaries(_keys, inner, max_size=4)),
    max_leaves=20)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_values)
def test_any_storable_value_round_trips_exactly(obj):
    assert same(roundtrip(obj), obj)


# -- decoding never runs code --------------------------------------------------------------
class _Plant:
    """A pickle whose loading would create a marker file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_a_pickle_payload_is_refused_and_never_runs(tmp_path, protocol):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"state": _Plant(str(marker))}, protocol=protocol)
    with pytest.raises(CorruptCheckpointError) as err:
        decode_object(as_tensor(payload), KEY)
    assert KEY in str(err.value) and "\n" not in str(err.value)
    if protocol >= 2:  # says why
        assert "pickle bytes, which moepec never loads" in str(err.value)
    assert not marker.exists()
    assert isinstance(err.value, CheckpointError)  # recovery treats it as a damaged item


def _t(dtype="float32", shape=(2,), data=None, tag="__tensor__"):
    data = base64.b64encode(bytes(8)).decode() if data is None else data
    return {tag: {"dtype": dtype, "shape": list(shape), "data": data}}


MALFORMED_BYTES = [
    b"", b"not json", b"\xff\xfe{}", b"[]", b'{"format":"moepec-object/1"}',
    b'{"format":"moepec-object/9","value":1}', b'{"format":"moepec-object/1","value":NaN}',
    b'{"format":"moepec-object/1","value":1e999}',
    b'{"format":"moepec-object/1","value":{"a":1,"a":2}}',
    b'{"format":"moepec-object/1","value":1,"extra":2}',
    b'{"format":"moepec-object/1","value":' + b"[" * 5000 + b"]" * 5000 + b"}",
]
MALFORMED_VALUES = [
    {"__pickle__": "gASV"}, {"__tuple__": [1], "x": 2}, {"__tuple__": 1}, {"__dict__": {}},
    {"__dict__": [[1]]}, {"__dict__": [[[1], 2]]}, {"__dict__": [[1, 2], [1, 3]]},
    {"__dict__": [[{"__tensor__": _t()["__tensor__"]}, 1]]}, {"__float__": "NaN"},
    {"__float__": 1.0}, {"__float__": [1]}, {"__float__": {"a": 1}}, _t(dtype="object"), _t(dtype="torch.float32"), _t(dtype="uint32"),
    _t(dtype=["float32"]), _t(shape=(3,)), _t(shape=(-1,)), _t(shape=(2.0,)),
    _t(shape=(True, 2)), _t(shape=[1] * 65), _t(data="***"), _t(data=7),
    _t(dtype="bool", shape=(8,), data=base64.b64encode(bytes([0, 1, 2, 0, 0, 0, 0, 0])).decode()),
    _t(dtype="bfloat16", shape=(2, 2), data="AAAA"),
    {"__tensor__": {"dtype": "float32", "shape": [0]}},
    {"__tensor__": {"dtype": "float32", "shape": [0], "data": "", "device": "cuda"}},
    _t(dtype="object", tag="__ndarray__"), _t(dtype="bfloat16", tag="__ndarray__"),
    _t(dtype="uint8", shape=(2, 4), tag="__npscalar__"), [[{"__nope__": 0}]],
    {"__tensor__": [1, 2]},
]


def _nested(depth: int):
    v = 0
    for _ in range(depth):
        v = [v]
    return v


@pytest.mark.parametrize("data", MALFORMED_BYTES, ids=range(len(MALFORMED_BYTES)))
def test_malformed_documents_are_corrupt(data):
    _assert_corrupt(as_tensor(data))


@pytest.mark.parametrize("value", MALFORMED_VALUES, ids=range(len(MALFORMED_VALUES)))
def test_malformed_values_are_corrupt(value):
    _assert_corrupt(raw_doc(value))


def test_too_deep_and_wrongly_typed_items_are_corrupt():
    _assert_corrupt(raw_doc(_nested(MAX_DEPTH + 5)))
    assert roundtrip(_nested(MAX_DEPTH - 1)) == _nested(MAX_DEPTH - 1)
    good = encode_object({"a": 1}, "obj")
    for bad in (good.to(torch.int8), good.reshape(1, -1), good.float(), "text"):
        _assert_corrupt(bad)


def _assert_corrupt(t) -> None:
    with pytest.raises(CorruptCheckpointError) as err:
        decode_object(t, KEY)
    msg = str(err.value)
    assert KEY in msg and "\n" not in msg and len(msg) < 600, msg


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_are_corrupt(data):
    try:
        decode_object(as_tensor(data), KEY)
    except CorruptCheckpointError:
        pass


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=6) | st.sampled_from(["float32", "bool", "nan", "AAAA", "", "inf"]),
    lambda inner: (st.lists(inner, max_size=4)
                   | st.dictionaries(st.text(max_size=4) | st.sampled_from(
                       ["__tuple__", "__dict__", "__float__", "__tensor__", "__ndarray__",
                        "__npscalar__", "__x__", "dtype", "shape", "data"]), inner, max_size=4)),
    max_leaves=15)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_any_json_value_decodes_or_is_corrupt(value):
    try:
        decode_object(raw_doc(value), KEY)
    except CorruptCheckpointError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_damaged_documents_decode_or_are_corrupt(data):
    good = encode_object({"t": torch.arange(3), 1: (np.ones(2), "x", math.nan)}, "obj")
    raw = bytearray(good.numpy().tobytes())
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        decode_object(as_tensor(bytes(raw)), KEY)
    except CorruptCheckpointError:
        pass


# -- refusing what cannot be stored --------------------------------------------------------
class _Sched:
    """A scheduler-like object whose state_dict() the test controls."""

    def __init__(self, state) -> None:
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state) -> None:
        self.state = state


class _Custom:
    pass


REFUSED = [  # (state_dict(), what the message says after "extra_state['sched'] state_dict()")
    ({"lr_lambdas": [lambda s: 1.0]}, re.escape("['lr_lambdas'][0] is a function;")),
    ({"f": print}, re.escape("['f'] is a function;")),
    ({"seen": {1, _Custom}}, re.escape("['seen'] is a set holding a type;")),
    ({"obj": _Custom()}, r"\['obj'\] is a (tests\.)?test_objects\._Custom;"),
    ({"t": torch.ones(2, dtype=torch.uint32)}, re.escape("['t'] is a uint32 tensor (dtypes")),
    ({"a": np.array(["x"], dtype=object)},
     re.escape("['a'] is a numpy array of dtype object (dtypes")),
    ({"s": torch.ones(2).to_sparse()},
     re.escape("['s'] is a torch.Tensor (torch.sparse_coo); store a plain dense tensor;")),
    ({frozenset([1]): 0}, re.escape(" key frozenset({1}) is a frozenset; dict keys must be")),
    ({(1, torch.ones(1)): 0}, re.escape(" key (1, tensor([1.])) is a tuple; dict keys must")),
    ({"b": bytearray(b"bytes")}, re.escape("['b'] is a bytearray;")),
]


@pytest.mark.parametrize(("state", "where"), REFUSED, ids=range(len(REFUSED)))
def test_unstorable_extra_state_is_refused_when_the_catalog_is_built(state, where):
    model, opt, _ = make()
    with pytest.raises(ConfigError) as err:
        StateCatalog(model, opt, discover(model), {"sched": _Sched(state)})
    msg = str(err.value)
    assert re.match(re.escape("extra_state['sched'] state_dict()") + where, msg), msg
    assert "\n" not in msg and "moepec stores only JSON values and tensors" in msg


def test_the_exact_message_for_a_lambda():
    model, opt, _ = make()
    with pytest.raises(ConfigError) as err:
        StateCatalog(model, opt, discover(model),
                     {"sched": _Sched({"lr_lambdas": [lambda s: 1.0]})})
    assert str(err.value) == (
        "extra_state['sched'] state_dict()['lr_lambdas'][0] is a function; moepec stores "
        "only JSON values and tensors: make state_dict() return plain data")


def test_a_state_that_turns_unstorable_is_refused_at_capture():
    model, opt, _ = make()
    sched = _Sched({"n": 1})
    catalog = StateCatalog(model, opt, discover(model), {"sched": sched})
    catalog.capture_objects()
    sched.state = {"n": 1, "cycle": _nested(MAX_DEPTH + 5)}
    with pytest.raises(ConfigError, match=r"^extra_state\['sched'\] state_dict\(\)\['cycle'\]"):
        catalog.capture_objects()
    looped: list = []
    looped.append(looped)
    sched.state = {"loop": looped}
    with pytest.raises(ConfigError, match="contains itself"):
        catalog.capture_objects()
    opt.param_groups[0]["hook"] = lambda: None
    sched.state = {"n": 1}
    with pytest.raises(ConfigError, match=r"^optimizer.param_groups\[0\]\['hook'\] is a function"):
        catalog.capture_objects()


def test_a_state_dict_that_fails_at_construction_is_checked_at_capture():
    class NotReady(_Sched):
        def state_dict(self):
            if self.state is None:
                raise RuntimeError("call after the first epoch")
            return self.state

    model, opt, _ = make()
    late = NotReady(None)
    catalog = StateCatalog(model, opt, discover(model), {"late": late})
    late.state = {"f": len}
    with pytest.raises(ConfigError, match=r"extra_state\['late'\]"):
        catalog.capture_objects()


# -- what the catalogue stores -------------------------------------------------------------
def _loader(seed: int = 3) -> TokenLoader:
    return TokenLoader(np.arange(5000) % 251, seq_len=8, batch_size=4, seed=seed)


def _catalog(seed=0, lr=1e-2):
    model, opt, sched = make(seed, lr=lr)
    loader, counter = _loader(), Counter()
    extra = {"sched": sched, "loader": loader, "data": counter}
    return StateCatalog(model, opt, discover(model), extra), model, opt, extra


def test_scheduler_loader_and_counter_round_trip_through_the_catalog():
    cat, model, opt, extra = _catalog()
    for _ in range(3):
        model(torch.randn(4, 8))[0].sum().backward()
        opt.step()
        extra["sched"].step()
        extra["loader"].next_batch()
    extra["data"].position = 7
    saved = {k: v.state_dict() for k, v in extra.items()}
    objects = cat.capture_objects()
    assert sorted(objects) == sorted(cat.object_keys())
    cat2, _, opt2, extra2 = _catalog(seed=1, lr=0.5)
    cat2.load(objects)
    for name, obj in extra2.items():
        assert same(obj.state_dict(), saved[name]), name
    assert extra2["sched"].get_last_lr() == extra["sched"].get_last_lr()
    a, b = extra["loader"].next_batch(), extra2["loader"].next_batch()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def _hyper(opt):
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def test_optimizer_hyper_parameters_restore_exactly_with_tuples():
    model, _, _ = make()
    opt = torch.optim.Adam([{"params": list(model.embed.parameters()), "lr": 0.1,
                             "betas": (0.8, 0.95)},
                            {"params": [p for n, p in model.named_parameters()
                                        if not n.startswith("embed.")],
                             "weight_decay": 0.01, "lr": torch.tensor(3e-4)}], lr=1e-3)
    cat = StateCatalog(model, opt, discover(model))
    saved = _hyper(opt)
    objects = cat.capture_objects()
    for g in opt.param_groups:  # drift everything, then restore
        g.update(betas=(0.1, 0.2), eps=1.0, weight_decay=0.5, amsgrad=True)
        g["lr"] = g["lr"] * 7 if isinstance(g["lr"], float) else g["lr"].mul_(7)
    lr_tensor = opt.param_groups[1]["lr"]
    cat.load({"objects/optim_groups": objects["objects/optim_groups"]})
    assert same(_hyper(opt), saved)
    assert opt.param_groups == [dict(h, params=g["params"])
                                for h, g in zip(saved, opt.param_groups)]
    assert type(opt.param_groups[0]["betas"]) is tuple
    assert opt.param_groups[1]["lr"] is lr_tensor  # a tensor lr is updated in place


def test_a_bad_object_leaves_the_live_state_untouched(tmp_path):
    cat, model, opt, extra = _catalog()
    objects = cat.capture_objects()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Plant(str(marker)), protocol=2)
    values = {"model/embed.weight": torch.zeros(8, 8), **objects,
              "objects/extra/data": as_tensor(evil)}
    extra["data"].position = 5
    with pytest.raises(CorruptCheckpointError, match="objects/extra/data.*pickle bytes"):
        cat.load(values)
    assert not marker.exists() and extra["data"].position == 5
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    for key, value in {"objects/extra/data": encode_object([1], "x"),
                       "objects/optim_groups": encode_object([{"params": [0]}], "x"),
                       "objects/rng": encode_object({"torch": 1}, "x")}.items():
        with pytest.raises(CorruptCheckpointError, match=re.escape(key)):
            cat.load({key: value})


# -- random number generators --------------------------------------------------------------
def _draws():
    return (torch.rand(4).tolist(), torch.randn(2).tolist(), random.random(),
            random.gauss(0, 1), random.getrandbits(64), np.random.rand(3).tolist(),
            np.random.randn(3).tolist())


def test_rng_states_restore_the_same_numbers():
    random.gauss(0, 1)  # leaves a cached gaussian in both python and numpy states
    np.random.randn(1)
    doc = encode_object(rng_state(), "the RNG state")
    first = _draws()
    _draws()  # move on
    set_rng_state(check_rng_state(decode_object(doc, "objects/rng"), "objects/rng"))
    assert _draws() == first
    state = check_rng_state(decode_object(doc, "objects/rng"), "objects/rng")
    assert type(state["python"]) is tuple and type(state["python"][1]) is tuple
    assert state["numpy"][1].dtype == np.uint32


def test_rng_states_restore_through_the_catalog():
    cat, *_ = _catalog()
    objects = cat.capture_objects()
    first = _draws()
    cat.load({"objects/rng": objects["objects/rng"]})
    assert _draws() == first


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_cuda_states_are_kept_and_skipped_with_a_warning_without_cuda(caplog):
    state = rng_state()
    state["cuda"] = [torch.get_rng_state(), torch.get_rng_state()]  # stand-ins: uint8 bytes
    decoded = check_rng_state(decode_object(encode_object(state, "rng"), "objects/rng"),
                              "objects/rng")
    assert len(decoded["cuda"]) == 2 and decoded["cuda"][0].dtype == torch.uint8
    first = _draws()
    set_rng_state(decoded)
    assert _draws() == first
    assert "CUDA is not available" in caplog.text


@pytest.mark.parametrize("mutate", [
    lambda s: s.pop("numpy"),
    lambda s: s.update(mars=1),
    lambda s: s.update(torch=s["torch"][:-1]),
    lambda s: s.update(torch=s["torch"].to(torch.int16)),
    lambda s: s.update(python=(3, s["python"][1][:-1], None)),
    lambda s: s.update(python=(3, s["python"][1][:-1] + (625,), None)),
    lambda s: s.update(python=list(s["python"])),
    lambda s: s.update(numpy=("PCG64",) + s["numpy"][1:]),
    lambda s: s.update(numpy=(s["numpy"][0], s["numpy"][1].astype(np.int64)) + s["numpy"][2:]),
    lambda s: s.update(numpy=s["numpy"][:2] + (625,) + s["numpy"][3:]),
    lambda s: s.update(cuda=[torch.ones(2)]),
    lambda s: s.update(cuda=torch.ones(2, dtype=torch.uint8)),
])
def test_malformed_rng_states_are_corrupt(mutate):
    state = rng_state()
    mutate(state)
    decoded = decode_object(encode_object(state, "rng"), "objects/rng")
    with pytest.raises(CorruptCheckpointError, match="objects/rng"):
        check_rng_state(decoded, "objects/rng")


def test_no_pickle_on_any_load_path():
    """moepec never unpickles: no pickle import, no torch.load without weights_only=True."""
    root = Path(__file__).resolve().parents[1] / "moepec"
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not {"pickle", "cPickle", "dill", "joblib"} & set(names), path
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("torch.load",
                                                                         "pickle.loads"):
                safe = [k for k in node.keywords if k.arg == "weights_only"
                        and isinstance(k.value, ast.Constant) and k.value.value is True]
                assert safe, f"{path}:{node.lineno}: {ast.unparse(node)}"
    assert (root / "state" / "objects.py").exists()
