"""One checkpoint root: the storage interface and its two backends.

``Storage(path, storage_options)`` opens ``path`` with the backend that serves it:
:class:`LocalStorage` (a local folder) or :class:`FsspecStorage` (``s3://``,
``memory://``, any other fsspec URL). :class:`Storage`'s docstring is the contract a
backend honours (exclusive create of the commit record, atomic small-file write, paths
confined to the root, what may lag); tests/test_storage_contract.py checks it on each.
"""

from moepec.store.quiet import no_gc, single_process_dcp
from moepec.store.storage.base import Location, Storage
from moepec.store.storage.local import LocalStorage
from moepec.store.storage.remote import FsspecStorage

__all__ = ["FsspecStorage", "LocalStorage", "Location", "Storage", "no_gc",
           "single_process_dcp"]
