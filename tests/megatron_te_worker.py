"""torchrun worker for tests/test_megatron.py: Transformer Engine's grouped experts
(``TEGroupedMLP``, swiglu, FP8 extra state) through the ("moepec", 1) backend, EP = world
size, with and without ``singleton_local_shards``.

    python -m torch.distributed.run --nproc_per_node N tests/megatron_te_worker.py DIR

The sharded state dict is Megatron-Core's own (``TEGroupedMLP.sharded_state_dict`` and
``TEGroupedLinear._sharded_state_dict_grouped``, with Megatron's optimizer): Transformer
Engine is the stand-in of tests/te_standin.py, installed before megatron imports (this
process only). For each layout: every (layer, expert) is found once over the ranks with
the same shards (its ``weight<i>``'s swiglu halves, ``linear_fc2``'s ``weight<i>``, both
``_extra_state`` objects, their Adam moments); three saves with K = 1 of 4 (weights,
moments and each expert's FP8 scales changed before each); a fresh model loads the last
folder and equals, bit for bit, the oracle of the documented rotation (as
tests/megatron_worker.py's). The test reads the folders' manifests for what each wrote.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections import Counter

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import te_standin  # noqa: E402

te_standin.install()  # before megatron: Megatron defines its TE classes at import
import megatron_shims  # noqa: E402

megatron_shims.install()

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.dist_checkpointing.dict_utils import nested_values  # noqa: E402
from megatron.core.dist_checkpointing.mapping import (  # noqa: E402
    ShardedObject,
    ShardedTensor,
    apply_factories,
)
from megatron_model import N_EXPERTS, build, sharded, snapshot  # noqa: E402
from megatron_worker import make_folder, oracle, train_a_bit  # noqa: E402

import moepec.integrations.megatron as mg  # noqa: E402


def grouped_linears(model) -> dict[str, te_standin.GroupedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, te_standin.GroupedLinear)}


def set_metadata(model, singleton: bool) -> None:
    """The run's choice of sharded keys, for every sharded_state_dict() call."""
    if singleton:
        model.sharded_state_dict = functools.partial(
            model.sharded_state_dict, metadata={"singleton_local_shards": True})


def new_scales(model, seed: int) -> None:
    """What FP8 training does to TE's extra state: new scales and amax histories, each
    GEMM (expert) its own."""
    for i, (_, lin) in enumerate(sorted(grouped_linears(model).items())):
        g = torch.Generator().manual_seed(seed * 1000 + i * 10 + dist.get_rank())
        for key, t in lin.fp8_state.items():
            lin.fp8_state[key] = torch.rand(t.shape, generator=g)


def state(model, opt) -> dict[str, torch.Tensor]:
    """Weights, Adam moments and each expert's FP8 scales, by a name whose parameter part
    names the expert (``...linear_fc1.weight<i>``) for the oracle."""
    out = snapshot(model, opt)
    for name, lin in grouped_linears(model).items():
        for key, t in lin.fp8_state.items():
            per_gemm = t.reshape(*t.shape[:-1], -1, lin.num_gemms)  # [..., tensors, gemm]
            for i in range(lin.num_gemms):
                out[f"fp8_{key}:{name}.weight{i}"] = per_gemm[..., i].clone()
    return out


def expert_shards(model, opt) -> dict:
    """This rank's expert units as the door reads them (Megatron's factories applied,
    as dist_checkpointing.save does): unit -> Counter of shard names."""
    sd = sharded(model, opt)
    apply_factories(sd)
    units: dict = {}
    for x in nested_values(sd):
        if isinstance(x, ShardedTensor):
            unit = mg.expert_unit(x)
        elif isinstance(x, ShardedObject):
            unit = mg.object_unit(x)
        else:
            continue
        if unit is not None:  # the shard's name inside its expert: no layer, no expert
            name = re.sub(r"^\d+\.", "", x.key.rsplit("experts.", 1)[1])
            kind = x.key.split(".")[2] if x.key.startswith("optimizer.state.") else "param"
            units.setdefault(unit, Counter())[f"{kind}:{name}"] += 1
    return units


def check_identity(model, opt, singleton: bool) -> None:
    units = expert_shards(model, opt)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, units)
    found = [u for rank_units in every for u in rank_units]
    assert len(found) == len(set(found)) == 2 * N_EXPERTS, found  # each once, over ranks
    per_layer = Counter(layer for layer, _ in found)
    assert sorted(per_layer.values()) == [N_EXPERTS, N_EXPERTS], per_layer
    assert all(sorted(e for lay, e in found if lay == layer) == list(range(N_EXPERTS))
               for layer in per_layer), found
    per_rank = N_EXPERTS // dist.get_world_size()
    mine = range(dist.get_rank() * per_rank, (dist.get_rank() + 1) * per_rank)
    assert sorted({e for _, e in units}) == list(mine), units
    fc1 = ("weight_w", "weight_v") if singleton else ("weight",) * 2  # swiglu's halves
    want = Counter()
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        want.update(f"{kind}:linear_fc1.{w}" for w in fc1)
        want[f"{kind}:linear_fc2.weight"] += 1
    want.update(["param:linear_fc1._extra_state", "param:linear_fc2._extra_state"])
    for unit, shards in units.items():
        assert shards == want, (unit, shards, want)


def run(root: str, singleton: bool) -> None:
    mg.register()  # a fresh front end for this save directory
    model, opt = build(seed=1, te_grouped=True)
    assert type(model.decoder.layers[0].mlp.experts).__name__ == "TEGroupedMLP"
    set_metadata(model, singleton)
    history = []
    for c in range(3):
        train_a_bit(model, opt, seed=c)
        if c == 0:  # Adam's moments exist after its first step
            check_identity(model, opt, singleton)
        new_scales(model, seed=c)
        history.append(state(model, opt))
        folder = os.path.join(root, f"iter_{c * 10:07d}")
        make_folder(folder)
        dist_checkpointing.save(sharded(model, opt), folder, sharded_strategy=("moepec", 1))
    fresh, fresh_opt = build(seed=2, te_grouped=True)
    set_metadata(fresh, singleton)
    loaded = dist_checkpointing.load(sharded(fresh, fresh_opt, loading=True), folder)
    fresh.load_state_dict(loaded["model"])
    fresh_opt.load_state_dict(loaded["optimizer"])
    got, expected = state(fresh, fresh_opt), oracle(history)
    assert got.keys() == expected.keys(), sorted(got.keys() ^ expected.keys())[:5]
    diff = [k for k in got if not torch.equal(got[k], expected[k])]
    assert not diff, f"rank {dist.get_rank()}: {len(diff)} differ, e.g. {diff[:3]}"
    report = mg.last_load_report()
    stale = sum(s["checkpoint"] != os.path.basename(folder) for s in report.sources.values())
    sys.stdout.write(f"rank {dist.get_rank()} TE OK singleton={singleton} {len(got)} "
                     f"tensors {stale} stale of {len(report.sources)}\n")
    sys.stdout.flush()


def main() -> None:
    root = sys.argv[1]
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
    for singleton in (False, True):
        run(os.path.join(root, "single" if singleton else "stacked"), singleton)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
