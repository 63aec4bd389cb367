"""The one manifest reader: every committed manifest of a root, read and validated once.

Restore, retention, inspect, verify and export all read a root through
:func:`committed_manifests`, which never trusts a directory listing of data files: a
checkpoint exists if and only if its manifest does (DESIGN.md, commit rule).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from moepec.errors import CheckpointError, ManifestError, ManifestFormatError
from moepec.keys import newest
from moepec.store.items import Items
from moepec.store.manifest import Manifest, StoredView
from moepec.store.storage import Storage, no_gc


@dataclass(slots=True)
class Committed:
    """What a checkpoint root holds, as read by :func:`committed_manifests`."""

    manifests: dict[str, Manifest]
    """Committed checkpoints whose manifest reads and validates, oldest first."""
    damaged: dict[str, ManifestError | CheckpointError]
    """Committed checkpoints whose manifest cannot be used, with the reason."""
    uncommitted: list[str]
    """Checkpoint folders without a manifest (never to be read)."""
    listing: list[tuple[str, bool]]
    """(name, committed) of every checkpoint folder, oldest first."""

    @property
    def newest(self) -> str | None:
        return newest(self.manifests)

    def newer_format(self) -> ManifestFormatError | None:
        """A manifest written by a newer moepec, if any: nothing may act as if it were
        absent (restoring or retaining past it would lose its progress)."""
        return next((e for e in self.damaged.values() if isinstance(e, ManifestFormatError)),
                    None)


def committed_manifests(storage: Storage, known: Mapping[str, Manifest] | None = None,
                        views: bool = False) -> Committed:
    """Read and validate every committed manifest under ``storage``'s root: the one reader
    that restore, retention, inspect, verify and export use.

    ``known`` holds manifests read before (a committed manifest never changes), which are
    not read again. ``views``: read every side file now, the view and the non-expert
    items (offline tools), so a damaged or missing one makes its manifest damaged;
    otherwise each is read on first use (a restore reads the view and the non-expert items
    of its base alone). Never raises for a damaged manifest: it is listed in ``damaged``.
    Reads only; any rank may call it, on any thread.
    """
    listing = storage.list_checkpoints()
    out = Committed(manifests={}, damaged={}, uncommitted=[], listing=listing)
    with no_gc():
        _read_committed(storage, listing, known, views, out)
    return out


def _read_committed(storage: Storage, listing: list[tuple[str, bool]],
                    known: Mapping[str, Manifest] | None, views: bool, out: Committed) -> None:
    for name, is_committed in listing:
        if not is_committed:
            out.uncommitted.append(name)
        elif known is not None and name in known:
            out.manifests[name] = known[name]
        else:
            try:
                manifest = storage.read_manifest(name)
            except CheckpointError as exc:
                out.damaged[name] = exc
                continue
            if manifest.name != name:  # a copied or renamed folder: its data is elsewhere
                out.damaged[name] = ManifestError(
                    f"{storage.url}/{name}: the manifest names checkpoint {manifest.name!r}")
                continue
            try:
                if views and isinstance(manifest.view, StoredView):
                    manifest.view.load()
                if views and isinstance(manifest.keys, Items):
                    manifest.keys.shared()
            except ManifestError as exc:
                out.damaged[name] = exc
            else:
                out.manifests[name] = manifest
