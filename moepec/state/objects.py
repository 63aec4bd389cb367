"""Small objects of a checkpoint as tagged JSON in a uint8 tensor; decoding runs no code.

A checkpoint's small objects (RNG states, optimizer hyper-parameters, every
``extra_state`` entry's ``state_dict()``) are each stored as one uint8 tensor holding a
UTF-8 (in fact ASCII) JSON document ``{"format": "moepec-object/1", "value": V}``.
``V`` is plain JSON for ``None``, ``bool``, ``int``, finite ``float``, ``str``, ``list``
and ``dict`` with string keys; everything else is a JSON object with exactly one
*tag* key (a string that starts and ends with ``__``):

- ``{"__tuple__": [...]}``: a tuple;
- ``{"__dict__": [[k, v], ...]}``: a dict whose keys are not all plain strings (int
  keys of an optimizer's state, or a string key shaped like a tag), in order; keys are
  ``None``/bool/int/float/str or tuples of them;
- ``{"__float__": "nan" | "inf" | "-inf"}``: a float that strict JSON cannot hold (the
  document is strict JSON: any JSON tool reads it);
- ``{"__tensor__": {"dtype", "shape", "data"}}``: a torch tensor, ``data`` the base64 of
  its raw little-endian bytes (decoded on the CPU); dtypes in :data:`TENSOR_DTYPES`;
- ``{"__ndarray__": {...}}`` / ``{"__npscalar__": {...}}``: a numpy array / scalar,
  the same fields, dtypes in :data:`NDARRAY_DTYPES`;
- ``{"__bytes__": "<base64>"}`` / ``{"__bytesio__": "<base64>"}``: bytes, or an
  ``io.BytesIO`` (its whole buffer; it comes back at position 0). The bytes are opaque:
  handed back as they came, never interpreted (Transformer Engine's ``_extra_state`` is
  an ``io.BytesIO`` that TE itself reads);
- ``{"__set__": [...]}`` / ``{"__frozenset__": [...]}``: a set of plain keys (None,
  bool, int, float, str, tuples of them), sorted by their JSON text;
- ``{"__namespace__": {...}}``: an ``argparse.Namespace`` (Megatron-LM's ``args``), its
  attributes as a dict; ``{"__dtype__": "bfloat16"}``: a ``torch.dtype`` (any of torch's);
- ``{"__enum__": ["module.Class", "member"]}``: a member of an enum class the caller
  allows (``enums=`` of both functions; decoding looks the class up in that list, never
  imports a name).

Decoding is ``json.loads`` plus a strict walker that builds only those types:
anything unexpected (not JSON, an unknown tag, a dtype off the list, data of the wrong
length, pickle bytes) raises :class:`~moepec.errors.CorruptCheckpointError` naming the
item's key. Encoding refuses anything else (a function, a custom class) with a
:class:`~moepec.errors.ConfigError` naming where it sits, so nothing is lost silently.
Pure: no I/O, no collectives.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import json
import math
import types
from argparse import Namespace
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from enum import Enum
from typing import Any

import numpy as np
import torch
from torch import nn

from moepec.errors import ConfigError, CorruptCheckpointError
from moepec.state.object_path import ObjectPath as _Path

FORMAT = "moepec-object/1"
"""The document format written; decoding accepts only this one."""
MAX_OBJECT_BYTES = 256 * 1024 * 1024
"""Largest encoded object (both ways): small objects are kilobytes; a loader state that
needs more belongs in tensors of the model or a file of its own."""
MAX_DEPTH = 100
"""Deepest nesting of containers (both ways); deeper is refused (also catches cycles)."""
MAX_NDIM = 64

TENSOR_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
              torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64)
}
"""Tensor dtypes an object may hold, by name."""
NDARRAY_DTYPES: dict[str, np.dtype] = {
    n: np.dtype(n) for n in ("bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16",
                             "int32", "int64", "float16", "float32", "float64", "complex64",
                             "complex128")
}
"""Numpy dtypes an object may hold (uint32 for numpy's RNG state), by name."""
DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in vars(torch).values()
                                  if isinstance(d, torch.dtype)}
"""``torch.dtype`` values an object may hold (torch's own, e.g. Megatron-LM's
``args.params_dtype``), by name."""
_ENUMS: ContextVar[Mapping[str, type[Enum]]] = ContextVar(
    "moepec_object_enums", default=types.MappingProxyType({}))
"""The enum classes the encode or decode in progress allows, by qualified name."""

_TAGS = ("__tuple__", "__dict__", "__float__", "__tensor__", "__ndarray__", "__npscalar__",
         "__bytes__", "__bytesio__", "__set__", "__frozenset__", "__namespace__",
         "__dtype__", "__enum__")
_SPECIAL_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType,
              types.BuiltinMethodType, functools.partial)
_PICKLE_PROTO = b"\x80"
"""The first byte of every pickle of protocol 2 or newer: named in the refusal."""


def _is_tag(key: str) -> bool:
    return len(key) >= 4 and key.startswith("__") and key.endswith("__")


# -- encoding ----------------------------------------------------------------------------
class _Refused(Exception):
    """An unstorable value at ``path`` (relative to the encoded object)."""

    def __init__(self, path: _Path, what: str) -> None:
        super().__init__(path, what)
        self.path, self.what = path, what


def _describe(x: Any) -> str:
    if isinstance(x, _FUNCTIONS):
        return "a function"
    t = type(x)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    return f"a {name}"


def _allowed(enums: Iterable[type[Enum]]) -> dict[str, type[Enum]]:
    return {f"{c.__module__}.{c.__qualname__}": c for c in enums}


def encode_object(obj: Any, where: str, fix: str = "make state_dict() return plain data",
                  enums: Iterable[type[Enum]] = ()) -> torch.Tensor:
    """``obj`` as a uint8 tensor holding its JSON document (see the module docstring).

    Any thread; reads ``obj`` only. ``where`` names the object in errors, e.g.
    ``"extra_state['sched'] state_dict()"``; ``enums``: the enum classes whose members
    it may hold (those its reader allows). Raises ConfigError, one line naming the
    offending path and type, for a value moepec does not store, ending with ``fix``."""
    token = _ENUMS.set(_allowed(enums))
    try:
        doc = json.dumps({"format": FORMAT, "value": _enc(obj, _Path.root(""), 0)},
                         allow_nan=False, separators=(",", ":"))
    except _Refused as exc:
        raise ConfigError(f"{where}{exc.path} is {exc.what}; moepec stores only JSON values "
                          f"and tensors: {fix}") from None
    except ValueError as exc:  # an int beyond Python's int-to-str digit limit
        raise ConfigError(f"{where} cannot be written as JSON ({exc}); {fix}") from None
    finally:
        _ENUMS.reset(token)
    data = doc.encode("ascii")
    if len(data) > MAX_OBJECT_BYTES:
        raise ConfigError(f"{where} takes {len(data)} bytes as JSON, more than moepec's "
                          f"{MAX_OBJECT_BYTES} for a small object; {fix}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _enc(x: Any, path: _Path, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise _Refused(path, f"nested deeper than {MAX_DEPTH} levels (or contains itself)")
    if x is None or type(x) in (bool, int, str):
        return x
    if type(x) is float:
        return x if math.isfinite(x) else {"__float__": repr(x)}
    if isinstance(x, (Enum, torch.dtype, Namespace)):
        return _enc_named(x, path, depth)
    if isinstance(x, torch.Tensor):
        return {"__tensor__": _enc_tensor(x, path)}
    if isinstance(x, np.ndarray):
        return {"__ndarray__": _enc_array(x, path)}
    if isinstance(x, np.generic):
        return {"__npscalar__": _enc_array(np.asarray(x), path)}
    if isinstance(x, tuple) and not hasattr(x, "_fields"):  # a tuple or torch.Size
        return {"__tuple__": [_enc(v, path / i, depth + 1) for i, v in enumerate(x)]}
    if type(x) is list:
        return [_enc(v, path / i, depth + 1) for i, v in enumerate(x)]
    if isinstance(x, dict):  # OrderedDict and defaultdict come back as dict
        return _enc_dict(x, path, depth)
    if type(x) in (bytes, io.BytesIO):
        raw = x if type(x) is bytes else x.getvalue()
        tag = "__bytes__" if type(x) is bytes else "__bytesio__"
        return {tag: base64.b64encode(raw).decode()}
    if type(x) in (set, frozenset):
        return _enc_set(x, path, depth)
    raise _Refused(path, _describe(x))


def _enc_named(x: Enum | torch.dtype | Namespace, path: _Path, depth: int) -> Any:
    """An enum member of an allowed class, a torch.dtype or an argparse.Namespace."""
    if isinstance(x, torch.dtype):
        return {"__dtype__": str(x).removeprefix("torch.")}
    if type(x) is Namespace:
        return {"__namespace__": _enc_dict(vars(x), path, depth)}
    name = f"{type(x).__module__}.{type(x).__qualname__}"
    if not isinstance(x, Enum):  # a subclass of Namespace: it would come back as one
        raise _Refused(path, _describe(x))
    if _ENUMS.get().get(name) is not type(x):
        raise _Refused(path, f"{_describe(x)} (enums stored: "
                             f"{', '.join(_ENUMS.get()) or 'none here'})")
    return {"__enum__": [name, x.name]}


def _enc_set(x: set | frozenset, path: _Path, depth: int) -> Any:
    for v in x:
        if not _plain_key(v):
            raise _Refused(path, f"a set holding {_describe(v)}; set members must be None, "
                           f"bool, int, float, str or tuples of them")
    members = sorted((_enc(v, path, depth + 1) for v in x), key=json.dumps)
    return {"__set__" if type(x) is set else "__frozenset__": members}


def _enc_dict(x: dict, path: _Path, depth: int) -> Any:
    items = [(k, _enc(v, path / k, depth + 1)) for k, v in x.items()]
    if all(type(k) is str and not _is_tag(k) for k in x):
        return dict(items)
    for k in x:
        if not _plain_key(k):
            raise _Refused(path.key(k), f"{_describe(k)}; dict keys must be None, "
                           f"bool, int, float, str or tuples of them")
    return {"__dict__": [[_enc(k, path, depth + 1), v] for k, v in items]}


def _enc_tensor(t: torch.Tensor, path: _Path) -> dict[str, Any]:
    if type(t) not in (torch.Tensor, nn.Parameter) or t.layout != torch.strided:
        raise _Refused(path, f"{_describe(t)} ({t.layout}); store a plain dense tensor")
    name = str(t.dtype).removeprefix("torch.")
    if name not in TENSOR_DTYPES:
        raise _Refused(path, f"a {name} tensor (dtypes stored: {', '.join(TENSOR_DTYPES)})")
    if t.device.type == "meta":
        raise _Refused(path, "a tensor on the meta device (it has no data)")
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"dtype": name, "shape": list(t.shape), "data": base64.b64encode(raw).decode()}


def _enc_array(a: np.ndarray, path: _Path) -> dict[str, Any]:
    name = a.dtype.name
    if name not in NDARRAY_DTYPES or a.dtype.fields is not None:
        raise _Refused(path, f"a numpy array of dtype {a.dtype} (dtypes stored: "
                             f"{', '.join(NDARRAY_DTYPES)})")
    little = np.ascontiguousarray(a, dtype=NDARRAY_DTYPES[name].newbyteorder("<"))
    return {"dtype": name, "shape": list(a.shape),
            "data": base64.b64encode(little.tobytes()).decode()}


# -- decoding ----------------------------------------------------------------------------
class _Bad(Exception):
    """Why a document is malformed; decode_object turns it into CorruptCheckpointError."""


def decode_object(t: torch.Tensor, key: str, enums: Iterable[type[Enum]] = ()) -> Any:
    """The object a tensor from :func:`encode_object` holds; runs no code from the data.

    Any thread. Tensors in the object come back on the CPU; an enum member only of a
    class in ``enums``. Raises CorruptCheckpointError (one line, naming ``key``) for
    anything but a well-formed document, pickle bytes included."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise _corrupt(key, "not a 1-d uint8 tensor")
    if t.numel() > MAX_OBJECT_BYTES:
        raise _corrupt(key, f"{t.numel()} bytes, more than the {MAX_OBJECT_BYTES} allowed")
    data = t.detach().cpu().contiguous().numpy().tobytes()
    if data.startswith(_PICKLE_PROTO):
        raise _corrupt(key, "pickle bytes, which moepec never loads (unpickling can run code)")
    token = _ENUMS.set(_allowed(enums))
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constant,
                         object_pairs_hook=_no_duplicates)
        return _dec_document(doc)
    except _Bad as exc:
        raise _corrupt(key, str(exc)) from None
    except (ValueError, RecursionError) as exc:  # also UnicodeDecodeError, JSONDecodeError
        raise _corrupt(key, f"not a JSON document ({type(exc).__name__})") from None
    except TypeError as exc:  # not expected (every field's type is checked); never escapes
        raise _corrupt(key, f"a field of the wrong type ({exc})") from None
    finally:
        _ENUMS.reset(token)


def _corrupt(key: str, reason: str) -> CorruptCheckpointError:
    reason = reason.replace("\n", " ")[:300]
    return CorruptCheckpointError(
        f"checkpoint item {key!r} is not a valid moepec object: {reason}; the item is "
        f"damaged or was not written by moepec (it is never executed)")


def _no_constant(name: str) -> Any:
    raise _Bad(f"{name} is not strict JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Bad("a JSON object repeats a key")
    return out


def _dec_document(doc: Any) -> Any:
    if type(doc) is not dict or set(doc) != {"format", "value"}:
        raise _Bad('not a {"format", "value"} document')
    if doc["format"] != FORMAT:
        raise _Bad(f"format {str(doc['format'])[:40]!r}, expected {FORMAT!r} (a newer moepec?)")
    return _dec(doc["value"], _Path.root("value"), 0)


def _dec(x: Any, path: _Path, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise _Bad(f"{path} is nested deeper than {MAX_DEPTH} levels")
    if x is None or type(x) in (bool, int, str):
        return x
    if type(x) is float:
        if not math.isfinite(x):  # "1e999" parses as inf; moepec writes {"__float__": "inf"}
            raise _Bad(f"{path} is a float out of range")
        return x
    if type(x) is list:
        return [_dec(v, path / i, depth + 1) for i, v in enumerate(x)]
    assert type(x) is dict  # json.loads builds nothing else
    tags = [k for k in x if _is_tag(k)]
    if not tags:
        return {k: _dec(v, path / k, depth + 1) for k, v in x.items()}
    tag = tags[0]
    if len(x) != 1 or tag not in _TAGS:
        raise _Bad(f"{path} has an unknown tag {tag[:40]!r} or extra keys")
    return _dec_tagged(tag, x[tag], path, depth)


def _dec_tagged(tag: str, body: Any, path: _Path, depth: int) -> Any:
    if tag == "__tuple__":
        return tuple(_dec(v, path / i, depth + 1) for i, v in enumerate(_list(body, path)))
    if tag == "__dict__":
        return _dec_pairs(_list(body, path), path, depth)
    if tag == "__float__":
        if type(body) is not str or body not in _SPECIAL_FLOATS:
            raise _Bad(f"{path} is a __float__ other than nan, inf, -inf")
        return _SPECIAL_FLOATS[body]
    if tag == "__tensor__":
        return _dec_tensor(body, path)
    if tag in ("__bytes__", "__bytesio__"):
        raw = _b64(body, path)
        return raw if tag == "__bytes__" else io.BytesIO(raw)
    if tag in ("__set__", "__frozenset__"):
        members = [_dec(v, path, depth + 1) for v in _list(body, path)]
        if not all(_plain_key(v) for v in members) or len(set(members)) != len(members):
            raise _Bad(f"{path}: a set member is of a type moepec does not write, or repeated")
        return set(members) if tag == "__set__" else frozenset(members)
    if tag in ("__namespace__", "__dtype__", "__enum__"):
        return _dec_named(tag, body, path, depth)
    arr = _dec_array(body, path)
    return arr if tag == "__ndarray__" else _scalar(arr, path)


def _dec_named(tag: str, body: Any, path: _Path, depth: int) -> Any:
    if tag == "__namespace__":
        attrs = _dec(body, path, depth + 1)
        if type(attrs) is not dict or not all(type(k) is str for k in attrs):
            raise _Bad(f"{path}: a __namespace__ is not a dict with string keys")
        return Namespace(**attrs)
    if tag == "__dtype__":
        if type(body) is not str or body not in DTYPES:
            raise _Bad(f"{path}: {str(body)[:40]!r} is not a torch dtype")
        return DTYPES[body]
    cls = _ENUMS.get().get(body[0]) if type(body) is list and len(body) == 2 \
        and type(body[0]) is str else None
    if cls is None or type(body[1]) is not str or body[1] not in cls.__members__:
        raise _Bad(f"{path}: {str(body)[:80]} is not a member of an enum this reader "
                   f"allows ({', '.join(_ENUMS.get()) or 'none'})")
    return cls.__members__[body[1]]


def _list(x: Any, path: _Path) -> list:
    if type(x) is not list:
        raise _Bad(f"{path}: a tag's body is not a list")
    return x


def _dec_pairs(pairs: list, path: _Path, depth: int) -> dict:
    out: dict = {}
    for pair in pairs:
        if type(pair) is not list or len(pair) != 2:
            raise _Bad(f"{path}: a __dict__ entry is not a [key, value] pair")
        k = _dec(pair[0], path, depth + 1)
        if not _plain_key(k) or k in out:
            raise _Bad(f"{path}: a __dict__ key is unhashable, of a type moepec does not "
                       f"write, or repeated")
        out[k] = _dec(pair[1], path / k, depth + 1)
    return out


def _plain_key(k: Any) -> bool:
    if k is None or type(k) in (bool, int, float, str):
        return True
    return type(k) is tuple and all(_plain_key(v) for v in k)


def _raw(body: Any, path: _Path, names: dict[str, Any]) -> tuple[Any, list[int], bytes]:
    """(dtype, shape, bytes) of a __tensor__/__ndarray__ body, every field checked."""
    if type(body) is not dict or set(body) != {"dtype", "shape", "data"}:
        raise _Bad(f"{path}: an array body is not {{dtype, shape, data}}")
    dtype, shape, data = body["dtype"], body["shape"], body["data"]
    if type(dtype) is not str or dtype not in names:
        raise _Bad(f"{path}: dtype {str(dtype)[:40]!r} is not allowed")
    if (type(shape) is not list or len(shape) > MAX_NDIM
            or not all(type(n) is int and n >= 0 for n in shape)):
        raise _Bad(f"{path}: shape is not a list of at most {MAX_NDIM} sizes")
    return names[dtype], shape, _b64(data, path)


def _b64(data: Any, path: _Path) -> bytes:
    try:
        raw = base64.b64decode(data, validate=True) if type(data) is str else None
    except binascii.Error:
        raw = None
    if raw is None:
        raise _Bad(f"{path}: data is not base64")
    return raw


def _check_length(raw: bytes, shape: list[int], itemsize: int, path: _Path) -> None:
    if len(raw) != math.prod(shape) * itemsize:
        raise _Bad(f"{path}: {len(raw)} data bytes for shape {shape[:8]} of "
                   f"{itemsize}-byte elements")


def _dec_tensor(body: Any, path: _Path) -> torch.Tensor:
    dtype, shape, raw = _raw(body, path, TENSOR_DTYPES)
    _check_length(raw, shape, torch.empty((), dtype=dtype).element_size(), path)
    if dtype == torch.bool and raw.translate(None, b"\x00\x01"):
        raise _Bad(f"{path}: a bool tensor holds bytes other than 0 and 1")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def _dec_array(body: Any, path: _Path) -> np.ndarray:
    dtype, shape, raw = _raw(body, path, NDARRAY_DTYPES)
    _check_length(raw, shape, dtype.itemsize, path)
    if dtype == np.bool_ and raw.translate(None, b"\x00\x01"):
        raise _Bad(f"{path}: a bool array holds bytes other than 0 and 1")
    little = np.frombuffer(raw, dtype=dtype.newbyteorder("<"))
    return little.astype(dtype).reshape(shape)  # a native-order, writable copy


def _scalar(arr: np.ndarray, path: _Path) -> np.generic:
    if arr.shape != ():
        raise _Bad(f"{path}: a __npscalar__ has shape {list(arr.shape)[:8]}, not []")
    return arr[()]
