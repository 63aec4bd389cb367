"""The flat front end (public): PEC for a framework's own per-rank sharded state dict,
on the engine the manager uses (:mod:`moepec.flat.front`). A door imports only this and
:mod:`moepec`."""

from moepec.flat.front import FlatFrontEnd
from moepec.flat.level import RamFound, RamLevel
from moepec.flat.lineage import Choice
from moepec.flat.plan import FLAT_FIELDS, FlatPlan, Unit, natural
from moepec.flat.ram import FlatRam, check_ram_dir, check_ram_replicas, ram_report
from moepec.flat.regions import Region, parse_shard_key, shard_key
from moepec.state.objects import decode_object, encode_object
from moepec.store.flat import (  # read_manifest: a folder's validated manifest (its needs)
    read_manifest,
    split_folder,
    write_rank,
)
from moepec.store.reader import read_small  # a framework's small file (DeepSpeed's latest)

__all__ = ["FLAT_FIELDS", "Choice", "FlatFrontEnd", "FlatPlan", "FlatRam", "RamFound", "RamLevel", "Region",
           "Unit", "check_ram_dir", "check_ram_replicas", "decode_object", "encode_object", "natural",
           "parse_shard_key", "ram_report", "read_manifest", "read_small", "shard_key",
           "split_folder", "write_rank"]
