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
tests/megatron_worker.py's); the checks are tests/megatron_layouts.py's. The test reads
the folders' manifests for what each wrote.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import te_standin  # noqa: E402

te_standin.install()  # before megatron: Megatron defines its TE classes at import
import megatron_shims  # noqa: E402

megatron_shims.install()

import megatron_layouts as layouts  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron_layouts import saves_and_load  # noqa: E402
from megatron_model import snapshot  # noqa: E402


def grouped_linears(model) -> dict[str, te_standin.GroupedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, te_standin.GroupedLinear)}


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


make = functools.partial(layouts.make, "te", "TEGroupedMLP")


def main() -> None:
    root = sys.argv[1]
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
    for singleton in (False, True):
        saves_and_load(os.path.join(root, "single" if singleton else "stacked"), singleton,
                       functools.partial(make, singleton), state, "TE", perturb=new_scales)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
