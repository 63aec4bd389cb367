"""``moepec materialize`` on a Megatron save directory written through moepec: a
``torch_dist`` checkpoint of its stitched view (moepec.integrations.megatron_export)."""

from __future__ import annotations

import argparse
import json
import os


def is_megatron_save(path: str) -> bool:
    """Whether ``path`` is a Megatron folder saved through moepec (its ``metadata.json``
    names the moepec backend), or a save directory holding one."""
    folders = [path] + ([os.path.join(path, n) for n in sorted(os.listdir(path))]
                        if os.path.isdir(path) else [])
    for folder in folders:
        try:
            with open(os.path.join(folder, "metadata.json")) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and meta.get("sharded_backend") == "moepec":
            return True
    return False


def run_materialize(args: argparse.Namespace) -> int:
    from moepec.integrations.megatron_export import materialize

    done = materialize(args.path, args.out)
    print(f"wrote {done.tensors} tensors and {done.objects} sharded objects of {done.folder} "
          f"(each expert from its newest copy) to {done.out} as a torch_dist checkpoint; "
          f"Megatron without moepec loads it")
    return 0
