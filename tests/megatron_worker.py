"""torchrun worker for tests/test_megatron.py: a Megatron-Core MoE GPTModel (SequentialMLP,
EP = world size) saved with the ("moepec", 1) backend and loaded with a plain
``dist_checkpointing.load``.

    python -m torch.distributed.run --nproc_per_node N tests/megatron_worker.py PHASE DIR

PHASE ``save``: four saves (sync, and async through the usage code of docs/megatron.md,
which is run as written) with the weights and Adam moments changed before each, then a
fresh model and optimizer load the last folder with the guide's load(); the loaded
state must equal, bit for bit, the oracle: non-expert state as of the last save, each
expert as of the last save whose documented round-robin turn (K=1: all at c = 0, then
layer m saves expert (m + c - 1) mod N at checkpoint c) included it. PHASE ``save-crash``: the same,
then change the weights, start an async save and SIGKILL the writer and the rank
mid-save. PHASE
``resume``: the killed folder is not committed; the last committed one loads bit-exact
(its oracle saved by ``save``), and one more save commits on top of it.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import megatron_shims  # noqa: E402

megatron_shims.install()

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.dist_checkpointing.mapping import (  # noqa: E402
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron_model import N_EXPERTS, N_LAYERS, build, sharded, snapshot  # noqa: E402

import moepec.integrations.megatron as mg  # noqa: E402
from moepec.integrations.megatron import complete_next_save  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GUIDE: dict = {}


def train_a_bit(model, opt, seed: int) -> None:
    """What a training step does to the state (the forward does not run on CPU: the
    router moves weights to CUDA): new gradients, one Adam step."""
    for name, p in model.named_parameters():
        # Replicated (non-expert) state stays equal across data-parallel ranks, as after
        # a gradient all-reduce; each rank's experts get their own gradients.
        rank = dist.get_rank() if expert_of(name) else 0
        g = torch.Generator().manual_seed(seed * 100 + rank)
        p.grad = torch.randn(p.shape, generator=g)
    opt.optimizer.step()


def route(model, seed: int) -> torch.Tensor:
    """Route a batch through every MoE router's own routing function (the router's
    forward moves weights to CUDA, so the hooks moepec registered with
    ``track_routing`` are called here with what the forward would return). Returns the
    tokens per (layer, expert) summed over ranks, Megatron's own count."""
    counts = []
    for name in mg.moe_layer_names(model):
        router = model.get_submodule(name)
        g = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
        out = router.routing(torch.randn(6, 2, N_EXPERTS, generator=g))
        for hook in router._forward_hooks.values():
            hook(router, (None,), out)
        counts.append(out[1].sum(dim=0))
    total = torch.stack(counts).to(torch.int64)
    dist.all_reduce(total)
    return total


def expert_of(name: str) -> tuple[int, int] | None:
    """(MoE layer, global expert) of a SequentialMLP parameter name
    (``...local_experts.<i>...``) or a TEGroupedMLP one (``...experts...weight<i>``)."""
    parts = name.split(".")
    if "local_experts" in parts:
        local = int(parts[parts.index("local_experts") + 1])
    elif "experts" in parts and (m := re.fullmatch(r"(?:weight|bias)(\d+)", parts[-1])):
        local = int(m[1])
    else:
        return None
    layer = int(parts[parts.index("layers") + 1])
    per_rank = N_EXPERTS // dist.get_world_size()
    return layer, ps.get_expert_model_parallel_rank() * per_rank + local


def oracle(history: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The stitched state after len(history) saves, from the documented rotation."""
    last = len(history) - 1
    out = {}
    for key in history[last]:
        unit = expert_of(key.split(":", 1)[1])
        c = last
        if unit is not None:  # c = 0 is full; then layer m saves (m + c - 1) mod N
            while c > 0 and (unit[0] + c - 1) % N_EXPERTS != unit[1]:
                c -= 1
        out[key] = history[c][key]
    return out


def make_folder(folder: str) -> None:
    """Megatron's save needs the folder to exist (Megatron-LM's save_checkpoint makes it)."""
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()


def guide(ram_dir: str) -> dict:
    """The usage block of docs/megatron.md, run as written: its save() and load() are
    the ones these phases call (so the guide's code is what the tests prove), with its
    RAM level in ``ram_dir`` (the test's, not the user's /dev/shm/moepec)."""
    text = (REPO / "docs" / "megatron.md").read_text()
    code = text.split("## Usage", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert 'ram_dir="auto"' in code
    code = code.replace('ram_dir="auto"', f"ram_dir={ram_dir!r}")
    namespace: dict = {}
    exec(compile(code, "docs/megatron.md", "exec"), namespace)
    return namespace


def save(model, opt, folder: str, use_async: bool, queue: AsyncCallsQueue) -> None:
    if use_async:
        root, name = os.path.split(folder)
        GUIDE["save"](model, opt, root, int(name.removeprefix("iter_")))
        train_a_bit(model, opt, seed=999)  # the snapshot must not see this
        GUIDE["queue"].maybe_finalize_async_calls(blocking=True)
    else:
        make_folder(folder)
        dist_checkpointing.save(sharded(model, opt), folder, sharded_strategy=("moepec", 1))


def load_and_compare(root: str, folder: str, expected: dict[str, torch.Tensor]):
    model, opt = build(seed=12345)
    GUIDE["load"](model, opt, os.path.join(root, folder))
    got = snapshot(model, opt)
    assert got.keys() == expected.keys(), sorted(got.keys() ^ expected.keys())[:5]
    diff = [k for k in got if not torch.equal(got[k], expected[k])]
    assert not diff, f"rank {dist.get_rank()}: {len(diff)} differ, e.g. {diff[:3]}"
    report = mg.last_load_report()
    assert report is not None and report.checkpoint == folder
    stale = sorted(s["step"] for s in report.sources.values() if s["checkpoint"] != folder)
    # One write with its newline: unbuffered (PYTHONUNBUFFERED), print() writes the text
    # and the newline apart, and the two ranks' lines, on one pipe, can interleave.
    sys.stdout.write(f"rank {dist.get_rank()} OK {folder} {len(stale)} stale from steps "
                     f"{stale} of {len(report.sources)} PLT {report.plt:.6f}\n")
    sys.stdout.flush()
    return model, opt


def save_reference(model, opt, root: str) -> None:
    """The stitched state, saved with Megatron's own torch_dist backend: what a load at
    another layout must equal (Megatron reshards it itself)."""
    make_folder(os.path.join(root, "ref", "iter_0000030"))
    dist_checkpointing.save(sharded(model, opt), os.path.join(root, "ref", "iter_0000030"))


def objects_and_errors(root: str) -> None:
    """An io.BytesIO sharded object (Transformer Engine's _extra_state) saves and loads
    back as it came; an object only rank 1 cannot store fails the save on every rank at
    once (no rank left waiting in a collective)."""
    rank = dist.get_rank()
    blob = io.BytesIO()
    torch.save({"scale": torch.full((2,), float(rank))}, blob)  # TE's own bytes
    folder = os.path.join(root, "objects", "iter_0000001")
    make_folder(folder)

    def sd(value):
        return {"te": ShardedObject(f"layer{rank}.linear._extra_state", value, (1,), (0,),
                                    replica_id=0),
                "w": ShardedTensor.from_rank_offsets("w", torch.ones(2) * rank, (0, rank, 2))}
    dist_checkpointing.save(sd(blob), folder, sharded_strategy=("moepec", 1))
    back = dist_checkpointing.load(sd(None), folder)
    assert isinstance(back["te"], io.BytesIO) and back["te"].getvalue() == blob.getvalue()
    assert torch.equal(back["w"], torch.ones(2) * rank)
    bad = os.path.join(root, "objects", "iter_0000002")
    make_folder(bad)
    try:
        dist_checkpointing.save(sd(print if rank == 1 else blob), bad,
                                sharded_strategy=("moepec", 1))
    except CheckpointingException as exc:
        assert "rank 1" in str(exc) and "function" in str(exc), exc
    else:
        raise AssertionError("a save with an object rank 1 cannot store committed")
    sys.stdout.write(f"rank {rank} OBJECTS OK\n")
    sys.stdout.flush()


def reshard(root: str) -> None:
    """Load the EP 2 save at this run's layout (EP 1, one rank) with moepec, and the
    torch_dist reference with Megatron's own resharding: bit for bit the same."""
    model, opt = build(seed=4242)
    GUIDE["load"](model, opt, os.path.join(root, iter_name(30)))
    ref_model, ref_opt = build(seed=4343)
    state = dist_checkpointing.load(sharded(ref_model, ref_opt, loading=True),
                                    os.path.join(root, "ref", "iter_0000030"))
    ref_model.load_state_dict(state["model"])
    ref_opt.load_state_dict(state["optimizer"])
    got, expected = snapshot(model, opt), snapshot(ref_model, ref_opt)
    assert got.keys() == expected.keys() and len(got) > 0
    diff = [k for k in got if not torch.equal(got[k], expected[k])]
    assert not diff, f"{len(diff)} differ, e.g. {diff[:3]}"
    report = mg.last_load_report()
    sys.stdout.write(f"RESHARD OK {len(got)} tensors, {len(report.sources)} experts, "
                     f"PLT {report.plt:.6f}\n")
    sys.stdout.flush()


def pipeline_routing(root: str) -> None:
    """Pipeline parallel 2 over this run's two ranks (EP 1), four MoE layers: each
    stage's routers count at their place in the whole model (stage 1's two layers are
    L 2 and 3, not 0 and 1), so a save records every layer's counts summed over ranks."""
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    torch.manual_seed(5)
    cfg = TransformerConfig(
        num_layers=4, hidden_size=16, num_attention_heads=2, num_moe_experts=N_EXPERTS,
        moe_router_topk=2, moe_ffn_hidden_size=8, ffn_hidden_size=32,
        moe_token_dispatcher_type="allgather", use_cpu_initialization=True,
        add_bias_linear=False, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    model = GPTModel(cfg, get_gpt_layer_local_spec(num_experts=N_EXPERTS), vocab_size=32,
                     max_sequence_length=8, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage())
    mg.track_routing(model)
    table = torch.zeros(4, N_EXPERTS, dtype=torch.int64)
    for name in mg.moe_layer_names(model):
        router = model.get_submodule(name)
        g = torch.Generator().manual_seed(100 + router.layer_number)
        out = router.routing(torch.randn(6, 2, N_EXPERTS, generator=g))
        for hook in router._forward_hooks.values():
            hook(router, (None,), out)
        table[router.layer_number - 1] += out[1].sum(dim=0).to(torch.int64)
    dist.all_reduce(table)
    folder = os.path.join(root, "pp", iter_name(0))
    make_folder(folder)
    dist_checkpointing.save(model.sharded_state_dict(), folder, sharded_strategy=("moepec", 1))
    with open(os.path.join(folder, "moepec.json")) as f:
        recorded = json.load(f)["schedule"]["counts"]
    assert recorded == table.tolist() and table[2:].sum() > 0, (recorded, table.tolist())
    sys.stdout.write(f"rank {dist.get_rank()} PIPELINE ROUTING OK\n")
    sys.stdout.flush()


def final_save(root: str, model, opt, queue: AsyncCallsQueue) -> None:
    """complete_next_save on rank 1 only (a stop that reached one rank first): the next
    (async) save writes every expert on both ranks; a fresh model loads it bit for bit,
    every expert from it, no token lost; the save after it is K = 1 again."""
    train_a_bit(model, opt, seed=60)
    if dist.get_rank() == 1:
        complete_next_save()
    expected = snapshot(model, opt)
    save(model, opt, os.path.join(root, iter_name(60)), True, queue)
    fresh, fresh_opt = build(seed=4444)
    GUIDE["load"](fresh, fresh_opt, os.path.join(root, iter_name(60)))
    got = snapshot(fresh, fresh_opt)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    report = mg.last_load_report()
    assert {s["checkpoint"] for s in report.sources.values()} == {iter_name(60)}
    assert len(report.sources) == N_LAYERS * N_EXPERTS and report.lost_total == 0
    save(fresh, fresh_opt, os.path.join(root, iter_name(70)), False, queue)
    with open(os.path.join(root, iter_name(60), "moepec.json")) as f:
        complete = len(json.load(f)["experts_saved"])
    with open(os.path.join(root, iter_name(70), "moepec.json")) as f:
        after = len(json.load(f)["experts_saved"])
    assert (complete, after) == (N_LAYERS * N_EXPERTS, N_LAYERS), (complete, after)
    # Megatron-LM's end of training (its globals: a stand-in module, as Megatron-LM sets
    # them; benchmarks/megatron_upstream/lm_checkpointing.py runs the real one): the save
    # of --train-iters is complete with no call, the saves before it rotate on.
    lm = types.ModuleType("megatron.training.global_vars")
    lm._GLOBAL_ARGS = types.SimpleNamespace(train_iters=90)
    sys.modules[lm.__name__] = lm
    try:
        for it in (80, 90):
            save(fresh, fresh_opt, os.path.join(root, iter_name(it)), True, queue)
    finally:
        del sys.modules[lm.__name__]
    saved = []
    for it in (80, 90):
        with open(os.path.join(root, iter_name(it), "moepec.json")) as f:
            saved.append(len(json.load(f)["experts_saved"]))
    assert saved == [N_LAYERS, N_LAYERS * N_EXPERTS], saved
    sys.stdout.write(f"rank {dist.get_rank()} FINAL OK\n")
    sys.stdout.flush()


def iter_name(i: int) -> str:
    return f"iter_{i:07d}"


def oracle_path(root: str) -> str:
    return os.path.join(root, f"oracle-r{dist.get_rank()}.pt")


def main() -> None:
    phase, root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
    GUIDE.update(guide(root.rstrip("/") + "-ram"))  # beside the save directory
    queue = AsyncCallsQueue()
    model, opt = build(seed=1)
    if phase in ("save", "save-crash"):
        history = []
        mg.track_routing(model)
        routed = torch.zeros(N_LAYERS, N_EXPERTS, dtype=torch.int64)
        for i in range(4):
            train_a_bit(model, opt, seed=i)
            routed += route(model, seed=i)
            history.append(snapshot(model, opt))
            save(model, opt, os.path.join(root, iter_name(i * 10)), i % 2 == 1, queue)
        with open(os.path.join(root, iter_name(30), "moepec.json")) as f:
            recorded = json.load(f)["schedule"]["counts"]
        assert recorded == routed.tolist(), (recorded, routed.tolist())
        expected = oracle(history)
        torch.save(expected, oracle_path(root))
        load_and_compare(root, iter_name(30), expected)
    if phase == "save-crash":  # train on, and die in the middle of the next save
        train_a_bit(model, opt, seed=77)
        make_folder(os.path.join(root, iter_name(40)))
        req = dist_checkpointing.save(sharded(model, opt), os.path.join(root, iter_name(40)),
                                      sharded_strategy=("moepec", 1), async_sharded_save=True)
        queue.schedule_async_request(req)
        writer = queue.async_calls[-1].async_caller.process  # Megatron's forked writer
        started = os.path.join(root, iter_name(40), f"moepec-r{dist.get_rank()}")
        deadline = time.monotonic() + 30
        while not os.path.isdir(started) and time.monotonic() < deadline:
            time.sleep(0.001)  # kill it once it writes (it may be done: still uncommitted)
        os.kill(writer.pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    elif phase == "reshard":
        reshard(root)
    elif phase == "resume":
        expected = torch.load(oracle_path(root), weights_only=True)
        # torch_dist's writer starts a spawned helper process that a SIGKILLed rank
        # would orphan (holding the test's pipes): use it in this phase, which exits.
        save_reference(*load_and_compare(root, iter_name(30), expected), root)
        objects_and_errors(root)
        save(model, opt, os.path.join(root, iter_name(50)), True, queue)
        if dist.get_rank() == 0:
            with open(os.path.join(root, iter_name(50), "moepec.json")) as f:
                print("PARENT", json.load(f)["parent"], flush=True)
        final_save(root, model, opt, queue)
        pipeline_routing(root)
    queue.close()
    GUIDE["queue"].close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
