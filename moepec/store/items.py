"""The items of a checkpoint: one stored tensor each, as a manifest records it.

:class:`Item` is one entry (shape, dtype, size, checksum, writing rank, location in a
data file), :class:`Items` a manifest's entries, each validated on first use. Also the
field checks every manifest reader shares. Pure: JSON in, objects out.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from moepec.errors import ManifestError
from moepec.keys import EXPERT_PREFIX, is_state_key

try:
    import orjson
except ImportError:  # a dependency; without it, the standard library parses everything
    orjson = None


def parse_json(data: bytes | str) -> Any:
    """``json.loads(data)``, parsed by orjson where it can: 2-2.5x faster on the number
    arrays of a manifest (its counts, selectors and ledger grow with the experts; 128
    manifests of a 128-expert view took 25 ms to parse). What orjson refuses, the standard
    library parses as before: NaN and infinities, lone surrogates, encodings other than
    UTF-8, nesting over 1,024 levels. One difference: an integer beyond 64 bits is a float
    to orjson, which every count check refuses. Raises ValueError for what is not JSON
    (nesting too deep for the standard library included, not RecursionError)."""
    if orjson is not None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


class Serialization(StrEnum):
    """How DCP items are stored on disk (a manifest records which)."""

    RAW = "raw"
    """Raw tensor bytes (:mod:`moepec.store.dcp_raw`); read by moepec's DCP readers."""
    TORCH_SAVE = "torch_save"
    """Stock DCP (torch.save-framed items): any ``dcp.load`` reads it."""


DTYPE_SIZES = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2,
    "uint32": 4, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
"""The dtypes a checkpoint may hold (the allow-list), and their item sizes in bytes."""
MAX_DIMS = 8
_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
"""A data file is a plain name inside its checkpoint folder: no separator, no '..'."""


class Encoding(StrEnum):
    """How one item's bytes are framed in its data file."""

    RAW = "raw"
    """The tensor's contiguous bytes, native byte order."""
    TORCH_SAVE = "torch_save"
    """A torch.save record (read with ``torch.load(weights_only=True)``)."""


@dataclass(frozen=True, slots=True)
class Item:
    """One stored tensor of a checkpoint (or of a RAM snapshot: no checksum, rank or
    location)."""

    shape: list[int]
    dtype: str
    """torch dtype name without the ``torch.`` prefix (one of DTYPE_SIZES)."""
    nbytes: int = 0
    checksum: str | None = None
    """``xxh3:<hex>``; None for RAM copies."""
    rank: int | None = None
    """The rank that wrote it."""
    file: str | None = None
    """Data file inside the checkpoint folder; None for RAM copies."""
    offset: int = 0
    length: int = 0
    """Where the item's bytes are in ``file``."""
    encoding: str = Encoding.RAW

    def to_json(self) -> dict[str, Any]:
        out = {"shape": self.shape, "dtype": self.dtype, "nbytes": self.nbytes,
               "checksum": self.checksum, "rank": self.rank}
        if self.file is not None:
            out.update(file=self.file, offset=self.offset, length=self.length,
                       encoding=str(self.encoding))
        return out

    @classmethod
    def from_json(cls, d: Any, where: str) -> Item:
        """Parse and validate one entry (types, the dtype allow-list, sizes, location)."""
        # Runs for every item of every manifest a restore reads (1,730 for a 64-expert
        # view): plain type() checks (which also keep bools out of the counts) and loops,
        # no helpers or generators (~2.2 us an entry where those took ~3).
        if type(d) is not dict:
            raise ManifestError(f"{where}: an item entry is not an object")
        shape, dtype, nbytes = d.get("shape"), d.get("dtype"), d.get("nbytes", 0)
        if type(shape) is not list or len(shape) > MAX_DIMS:
            raise ManifestError(f"{where}: an item has an invalid shape {shape!r:.80}")
        for n in shape:
            if type(n) is not int or n < 0:
                raise ManifestError(f"{where}: an item has an invalid shape {shape!r:.80}")
        size = DTYPE_SIZES.get(dtype) if type(dtype) is str else None
        if size is None:
            raise ManifestError(f"{where}: an item has dtype {dtype!r:.40}, not one moepec "
                                f"stores")
        if type(nbytes) is not int or nbytes != math.prod(shape) * size:
            raise ManifestError(f"{where}: an item's nbytes {nbytes!r:.40} does not match "
                                f"its shape and dtype")
        checksum, rank = d.get("checksum"), d.get("rank")
        if not (checksum is None or type(checksum) is str) or not (
                rank is None or (type(rank) is int and rank >= 0)):
            raise ManifestError(f"{where}: an item has an invalid checksum or rank")
        file = d.get("file")
        if file is None:
            return cls(shape, dtype, nbytes, checksum, rank)
        offset, length, encoding = d.get("offset"), d.get("length"), d.get("encoding")
        if not (type(file) is str and plain_file(file)):
            raise ManifestError(f"{where}: an item's data file {file!r:.80} is not a plain "
                                f"file name inside the checkpoint")
        if not (type(offset) is int and offset >= 0 and type(length) is int and length >= 0) \
                or type(encoding) is not str or encoding not in _ENCODINGS:
            raise ManifestError(f"{where}: an item has an invalid offset/length/encoding")
        if encoding == Encoding.RAW and length != nbytes:
            raise ManifestError(f"{where}: a raw item's length {length} is not its nbytes "
                                f"{nbytes}")
        return cls(shape, dtype, nbytes, checksum, rank, file, offset, length, encoding)


_ENCODINGS = frozenset(e.value for e in Encoding)


class Items(Mapping[str, Item]):
    """A parsed manifest's items: key -> :class:`Item`, each entry checked by
    ``Item.from_json`` the first time it is looked up (ManifestError when it is bad).

    A restore of a K=1 view reads the non-expert items of one manifest and one expert of
    each of E others. So the expert entries are held apart from the non-expert ones
    (*shared*: the state every checkpoint repeats), which a manifest of format moepec/6
    keeps in a file of its own: ``shared`` is then a callable that reads and checks them
    on first use (raising ManifestError, kept: every later use raises it too). Looking up
    an expert key, or :meth:`expert_keys`, never reads them; iterating all keys does.
    Checking each entry on first use instead of all of them up front is what keeps that
    restore near the cost of one full load.
    """

    __slots__ = ("_experts", "_shared", "_load", "_error", "_parsed", "_where", "_all")

    def __init__(self, experts: dict[str, Any],
                 shared: dict[str, Any] | Callable[[], dict[str, Any]], where: str) -> None:
        self._experts, self._where = experts, where
        self._shared: dict[str, Any] | None = shared if isinstance(shared, dict) else None
        self._load = None if isinstance(shared, dict) else shared
        self._error: ManifestError | None = None
        self._parsed: dict[str, Item] = {}
        self._all: dict[str, Any] | None = None

    def shared(self) -> dict[str, Any]:
        """The raw non-expert entries (read on first use). Raises ManifestError when their
        file is missing or damaged."""
        if self._shared is None:
            if self._error is None:
                try:
                    self._shared = self._load()  # type: ignore[misc]
                except ManifestError as exc:
                    self._error = exc
            if self._error is not None:
                raise self._error
        return self._shared  # type: ignore[return-value]

    def _raw(self, key: object) -> Any:
        if type(key) is not str:
            return None
        return (self._experts if key.startswith(EXPERT_PREFIX) else self.shared()).get(key)

    def __getitem__(self, key: str) -> Item:
        item = self._parsed.get(key)
        if item is None:
            raw = self._raw(key)
            if raw is None:
                raise KeyError(key)
            item = self._parsed[key] = Item.from_json(raw, f"{self._where} item {key}")
        return item

    def __contains__(self, key: object) -> bool:
        return self._raw(key) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._experts) + len(self.shared())

    def keys(self):  # noqa: ANN201 - dict_keys: set operations at C speed (stitching)
        if self._all is None:
            self._all = {**self._experts, **self.shared()}
        return self._all.keys()

    def expert_keys(self):  # noqa: ANN201 - dict_keys, as keys()
        """The expert keys alone, without reading the non-expert entries."""
        return self._experts.keys()


def entries_total(raw: dict[str, Any], where: str) -> int:
    """The total bytes of a manifest's raw entries, with their keys and entry types
    checked (each entry in full on first use: :class:`Items`). Raises ManifestError."""
    check_keys(raw, where)
    entries = raw.values()
    sizes = ([e.get("nbytes", 0) for e in entries] if set(map(type, entries)) <= {dict}
             else [None])
    if not set(map(type, sizes)) <= {int} or (sizes and min(sizes) < 0):
        raise ManifestError(f"{where}: an item entry is not an object with a byte count")
    return sum(sizes)


def split_items(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(expert entries, non-expert entries) of one item list (a moepec/5 manifest's)."""
    experts = {k: v for k, v in raw.items() if k.startswith(EXPERT_PREFIX)}
    return experts, {k: v for k, v in raw.items() if not k.startswith(EXPERT_PREFIX)}


@functools.lru_cache(maxsize=1024)
def plain_file(file: str) -> bool:
    """A plain file name inside a checkpoint folder (few distinct names: cached)."""
    return bool(_FILE_RE.match(file)) and ".." not in file


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_keys(keys: Mapping[Any, Any], where: str) -> None:
    """Every key follows the state-key grammar (moepec.keys), or ManifestError."""
    if set(map(type, keys)) <= {str} and all(map(is_state_key, keys)):
        return  # the common case, at C speed
    bad = next(k for k in keys if not (type(k) is str and is_state_key(k)))
    raise ManifestError(f"{where}: {bad!r:.80} is not a moepec state key")


def need_field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> None:
    value = data.get(name)
    # bool is an int in Python; a count that reads `true` is still wrong
    if value is None or not isinstance(value, kind) or (
            isinstance(value, bool) and kind in (int, (int, float))):
        got = "missing" if value is None else f"a {type(value).__name__}"
        raise ManifestError(f"{where}: manifest field {name!r} is {got}")
