"""``moepec materialize``: DeepSpeed's own files from a moepec DeepSpeed save."""

from __future__ import annotations

import argparse


def _add_materialize(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a DeepSpeed save directory written through moepec")
    p.add_argument("out", help="a new folder for the DeepSpeed checkpoint")
    p.add_argument("--tag", default=None, help="which tag (default: the one `latest` names)")


def _run_materialize(args: argparse.Namespace) -> int:
    from moepec.cli.megatron import is_megatron_save, run_materialize
    if is_megatron_save(args.path):  # a Megatron save: a torch_dist checkpoint
        return run_materialize(args)
    from moepec.integrations.ds_export import materialize

    done = materialize(args.path, args.out, args.tag)
    print(f"wrote {len(done.files)} DeepSpeed files of {args.path} tag {done.tag} "
          f"(each expert from its newest copy) to {done.out}, and {args.out}/latest; "
          f"DeepSpeed without moepec loads it, zero_to_fp32.py reads it")
    return 0


def commands():
    """(name, help, add_arguments, run) of each subcommand here."""
    return [("materialize", "write a DeepSpeed save's stitched tag as DeepSpeed's own files",
             _add_materialize, _run_materialize)]
