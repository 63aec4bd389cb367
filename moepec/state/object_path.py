"""Where a value sits in an object that :mod:`moepec.state.objects` encodes or decodes
(``['lr_lambdas'][0]``), for its error messages. Pure."""

from __future__ import annotations

from typing import Any


class ObjectPath:
    """Where a value sits in an object, e.g. ``['lr_lambdas'][0]``; built as the walkers
    descend, formatted (at most 200 characters) only for an error message."""

    __slots__ = ("parent", "step", "kind")

    def __init__(self, parent: ObjectPath | None, step: Any, kind: str) -> None:
        self.parent, self.step, self.kind = parent, step, kind  # kind: root, item, key

    @staticmethod
    def root(name: str) -> ObjectPath:
        return ObjectPath(None, name, "root")

    def __truediv__(self, step: Any) -> ObjectPath:
        return ObjectPath(self, step, "item")

    def key(self, k: Any) -> ObjectPath:
        """The path of a dict key itself (not of its value)."""
        return ObjectPath(self, k, "key")

    def __str__(self) -> str:
        parts, p = [], self
        while p is not None:
            parts.append(p.step if p.kind == "root" else
                         f" key {p.step!r}" if p.kind == "key" else f"[{p.step!r}]")
            p = p.parent
        text = "".join(reversed(parts))
        return text if len(text) <= 200 else f"{text[:200]}..."
