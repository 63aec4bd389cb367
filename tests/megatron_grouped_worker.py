"""torchrun worker for tests/test_megatron.py: Megatron-Core's legacy grouped experts
(``GroupedMLP``, swiglu; what ``get_gpt_layer_local_spec(moe_grouped_gemm=True)`` builds)
through the ("moepec", 1) backend, EP = world size.

    python -m torch.distributed.run --nproc_per_node N tests/megatron_grouped_worker.py DIR

The sharded state dict is Megatron-Core's own (``GroupedMLP.sharded_state_dict``: its
``weight1`` / ``weight2`` factories, with Megatron's optimizer): ``grouped_gemm`` is the
stand-in of tests/grouped_gemm_standin.py, installed before megatron imports (this
process only), and a forward and backward through the experts runs on it. With
``singleton_local_shards`` (one key per expert) and without it (Megatron-LM's setting:
GroupedMLP stacks a rank's local experts in one shard, on its first local axis, which the
door cuts per expert): every (layer, expert) is found once over the ranks with its shards
(``weight1``'s swiglu halves, ``linear_fc1.weight_w`` / ``_v`` with singleton shards,
``weight2`` as ``linear_fc2.weight``, their Adam moments, both placeholder
``_extra_state`` objects); three saves with K = 1 of 4; a fresh model loads the last
folder and equals, bit for bit, the oracle of the documented rotation (the checks of
tests/megatron_layouts.py). At 2 ranks, the stacked layout across EP: 2 -> 1 -> 2
(:func:`check_other_ep`).
"""

from __future__ import annotations

import functools
import os
import re
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import grouped_gemm_standin  # noqa: E402

grouped_gemm_standin.install()  # before megatron: grouped_gemm_util imports it
import megatron_shims  # noqa: E402

megatron_shims.install()

import megatron_layouts as layouts  # noqa: E402
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.transformer.moe.experts import GroupedMLP  # noqa: E402
from megatron_layouts import load_fresh, saves_and_load  # noqa: E402
from megatron_model import N_EXPERTS, sharded, snapshot  # noqa: E402
from megatron_worker import make_folder  # noqa: E402

import moepec.integrations.megatron as mg  # noqa: E402


def experts_of(model) -> dict[str, GroupedMLP]:
    return {n: m for n, m in model.named_modules() if isinstance(m, GroupedMLP)}


def per_expert(m: GroupedMLP, weight: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` (``weight1`` or ``weight2``, or its Adam moment) as ``[local expert, ...]``:
    the view GroupedMLP's forward and its sharded state dict take."""
    hidden = m.config.hidden_size
    return t.view(m.num_local_experts, hidden, -1) if weight == "weight1" else t.view(
        m.num_local_experts, -1, hidden)


def state(model, opt) -> dict[str, torch.Tensor]:
    """Weights and Adam moments; each GroupedMLP weight (and moment) cut into its local
    experts, by a name whose last part names the expert (``...weight1.weight<i>``) for
    the oracle."""
    out = snapshot(model, opt)
    for name, m in experts_of(model).items():
        for weight in ("weight1", "weight2"):
            for key in [k for k in out if k.endswith(f":{name}.{weight}")]:
                for i, t in enumerate(per_expert(m, weight, out.pop(key))):
                    out[f"{key}.weight{i}"] = t.clone()
    return out


def check_forward(model) -> None:
    """GroupedMLP's forward and backward on the gmm stand-in equal each expert's own
    swiglu MLP (fc1, silu(w) * v, times the routing prob, fc2) on its tokens."""
    m = next(iter(experts_of(model).values()))
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.tensor([3, 0, 2, 1][:m.num_local_experts])
    x = torch.randn(int(tokens.sum()), m.config.hidden_size, generator=g)
    probs = torch.rand(x.shape[0], generator=g)
    m.config.bf16 = True  # GroupedMLP's forward asserts bf16; the stand-in is dtype-blind
    try:
        out, _ = m(x, tokens, probs)
    finally:
        m.config.bf16 = False
    w1, w2 = per_expert(m, "weight1", m.weight1), per_expert(m, "weight2", m.weight2)
    want = []
    for e, (rows, p) in enumerate(zip(x.split(tokens.tolist()), probs.split(tokens.tolist()),
                                      strict=True)):
        h_w, h_v = (rows @ w1[e]).chunk(2, dim=-1)
        want.append((torch.nn.functional.silu(h_w) * h_v * p[:, None]) @ w2[e])
    torch.testing.assert_close(out, torch.cat(want))
    out.sum().backward()
    assert m.weight1.grad is not None and m.weight1.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def by_global_expert(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`state`'s names with the global expert (``...weight<g>``) for the local one,
    at the current EP."""
    first = ps.get_expert_model_parallel_rank() * (
        N_EXPERTS // ps.get_expert_model_parallel_world_size())
    return {re.sub(r"\.weight(\d+)$", lambda m: f".weight{first + int(m[1])}", k): v
            for k, v in values.items()}


def set_ep(ep: int) -> None:
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=ep)


def check_other_ep(root: str, expected: dict[str, torch.Tensor]) -> None:
    """At 2 ranks, the stacked layout across EP: 2 -> 1, a model at EP 1 (each rank all 4
    experts in one shard) loads the EP 2 saves' last folder (``expected``: this rank's
    oracle of it) and holds every rank's oracle; 1 -> 2, that model saves (a first save:
    every expert) and a model at EP 2 loads it: its own experts of the same oracle."""
    want: list = [None] * dist.get_world_size()
    dist.all_gather_object(want, by_global_expert(expected))
    whole = {k: v for part in want for k, v in part.items()}  # non-expert state: replicated
    set_ep(1)
    model, opt = load_fresh(functools.partial(make, False), os.path.join(
        root, "stacked", "iter_0000020"))
    equal(by_global_expert(state(model, opt)), whole, "2 -> 1")
    mg.register()
    folder = os.path.join(root, "stacked-ep1", "iter_0000000")
    make_folder(folder)
    dist_checkpointing.save(sharded(model, opt), folder, sharded_strategy=("moepec", 1))
    set_ep(dist.get_world_size())
    got = by_global_expert(state(*load_fresh(functools.partial(make, False), folder)))
    equal(got, {k: whole[k] for k in got}, "1 -> 2")
    assert got.keys() == want[dist.get_rank()].keys()
    sys.stdout.write(f"rank {dist.get_rank()} GROUPED EP OK 2 -> 1 -> 2\n")
    sys.stdout.flush()


def equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys())[:5])
    diff = [k for k in got if not torch.equal(got[k], want[k])]
    assert not diff, f"rank {dist.get_rank()} {what}: {len(diff)} differ, e.g. {diff[:3]}"


make = functools.partial(layouts.make, "legacy", "GroupedMLP")


def main() -> None:
    root = sys.argv[1]
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
    check_forward(make(True, seed=3)[0])
    saves_and_load(os.path.join(root, "single"), True, functools.partial(make, True),
                   state, "GROUPED")
    expected = saves_and_load(os.path.join(root, "stacked"), False,
                              functools.partial(make, False), state, "GROUPED")
    if dist.get_world_size() == 2:
        check_other_ep(root, expected)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
