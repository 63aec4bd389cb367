"""Which tag and files a DeepSpeed load reads through the door: ``latest``'s tag, or the
newest committed one when a save it names never committed; a moepec tag's model files
(DeepSpeed finds them by glob). Methods of
:class:`~moepec.integrations.deepspeed.PecCheckpointEngine` (this class is one of its
bases; they use its ``front``)."""

from __future__ import annotations

import fnmatch
import logging
import os
from typing import Any

from moepec.integrations.ds_export import read_latest
from moepec.integrations.ds_files import location

log = logging.getLogger(__name__)

MANIFEST = "moepec.json"
"""The manifest of a moepec tag folder: the tag is moepec's, and committed."""


class TagChoice:
    """The tag and file choice of a door."""

    front: Any

    def committed_tag(self, load_dir: str, tag: str | None) -> str | None:
        """The tag to load: ``tag``, else the one ``latest`` names; if that is a moepec
        save still uncommitted (the process died while it was written in the
        background), the newest committed tag of the directory, with a warning. Raises
        CheckpointError for a ``latest`` that is not a small regular file naming a plain
        tag folder of ``load_dir`` (:func:`~moepec.integrations.ds_export.read_latest`)."""
        if tag is not None:
            return tag
        named = read_latest(load_dir)
        if named is None:
            return None  # DeepSpeed says there is no `latest`
        root, where = location(load_dir, named)
        if os.path.exists(os.path.join(root, where, MANIFEST)) or \
                not os.path.isdir(os.path.join(root, where)) or root != \
                os.path.abspath(load_dir):
            return None  # committed, not moepec's, or a Trainer's folder: as DeepSpeed
        newest = self.front.newest(root)
        if newest is not None:
            log.warning("moepec: %s/%s (named by `latest`) never committed (the save was "
                        "interrupted); loading %s, the newest committed tag", load_dir,
                        named, newest)
        return newest

    def model_files(self, root: str, tag: str, pattern: str) -> list[str] | None:
        """The paths of a moepec tag's model files that DeepSpeed's glob ``pattern`` (a
        file name pattern: ``mp_rank_*``, ZeRO-3's ``zero_pp_rank_R_mp_rank_*``) would
        find; None for a tag that is not moepec's."""
        folder = os.path.join(os.path.abspath(root), str(tag))
        at = location(root, str(tag))
        if not os.path.exists(os.path.join(*at, MANIFEST)):
            return None
        names = {k.split("/", 1)[0] for k in self.front.keys(*at)}
        return sorted(os.path.join(folder, n) for n in names if fnmatch.fnmatchcase(n, pattern))
