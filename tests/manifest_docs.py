"""Tests' access to a stored manifest as JSON, with every item entry: the expert entries
of the manifest and the non-expert ones of its items file (format moepec/6), so that a
test can damage or forge any entry as a careful attacker would (the items file rewritten,
the manifest's reference to it recomputed to match)."""

from __future__ import annotations

import json
import os

import fsspec
import xxhash


def load(manifest: str, fs=None) -> tuple[dict, dict]:
    """(the manifest's JSON, every item entry: key -> entry) of the manifest at path
    ``manifest`` (``fs``: an fsspec file system; the local one by default)."""
    fs = fs or fsspec.filesystem("file")
    doc = json.loads(fs.cat(str(manifest)))
    items = dict(doc["keys"])
    if "items_file" in doc:
        folder = str(manifest).rsplit("/", 1)[0]
        items.update(json.loads(fs.cat(f"{folder}/{doc['items_file']['file']}")))
    return doc, items


def save(manifest: str, doc: dict, items: dict, fs=None) -> None:
    """Store ``items`` back with ``doc``: the expert entries in the manifest, the others in
    a new items file which the manifest names with its length and checksum (forged)."""
    fs = fs or fsspec.filesystem("file")
    doc = dict(doc, keys={k: v for k, v in items.items() if k.startswith("experts/")})
    if "items_file" in doc:
        data = json.dumps({k: v for k, v in items.items() if not k.startswith("experts/")},
                          sort_keys=True, separators=(",", ":")).encode()
        digest = xxhash.xxh3_64_hexdigest(data)
        ref = {"file": f"items-{digest}.json", "length": len(data),
               "checksum": f"xxh3:{digest}"}
        fs.pipe(f"{str(manifest).rsplit('/', 1)[0]}/{ref['file']}", data)
        doc["items_file"] = ref
    else:  # moepec/5: every entry in the manifest
        doc["keys"] = items
    fs.pipe(str(manifest), json.dumps(doc).encode())


def downgrade(folder) -> None:
    """Rewrite the checkpoint in ``folder`` (a local path) as moepec/5 stored it: every
    item in the manifest, no items file (moepec/5 is moepec/6 without that split)."""
    manifest = f"{folder}/moepec.json"
    doc, items = load(manifest)
    side = doc.pop("items_file")
    os.unlink(f"{folder}/{side['file']}")
    doc.update(format="moepec/5", keys=items)
    with open(manifest, "w") as f:
        json.dump(doc, f, sort_keys=True, separators=(",", ":"))
