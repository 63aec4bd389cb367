"""Megatron-Core's dist_checkpointing with the ("moepec", 1) backend
(moepec.integrations.megatron): a real MoE GPTModel (SequentialMLP) under torchrun, EP 1
(singleton keys) and EP 2 (the expert axis), saved K=1 of N=4 experts per layer, loaded back by a plain
``dist_checkpointing.load`` bit-exact against an oracle built from the documented
rotation (tests/megatron_worker.py); a save killed mid-write leaves the last committed
folder loadable; ``moepec verify`` names the folders each view needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs the megatron extra (make test installs it)")

import torch  # noqa: E402
from megatron.core.dist_checkpointing.mapping import (  # noqa: E402
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
)

from moepec.recovery.flat_view import verify_root  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "megatron_worker.py"
STRICT = REPO / "tests" / "megatron_strict.py"
STOCK = REPO / "tests" / "megatron_stock.py"
TE = REPO / "tests" / "megatron_te_worker.py"
GROUPED = REPO / "tests" / "megatron_grouped_worker.py"


def torchrun(nproc: int, phase: str | None, root: Path, singleton: bool = False,
             worker: Path = WORKER, args: list[str] | None = None
             ) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "MOEPEC_TEST_SINGLETON": "1" if singleton else "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), str(worker), *([phase] if phase else []), *(args or [str(root)])]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=240)


def ok_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return sorted(line for line in proc.stdout.splitlines() if " OK iter_" in line)


def test_a_routers_layer_counts_among_the_whole_models_moe_layers():
    """Layer L of track_routing: the MoE layers before the router's global layer
    (Megatron's 1-based layer_number, pipeline offset included), by moe_layer_freq."""
    from types import SimpleNamespace as NS

    mg = pytest.importorskip("moepec.integrations.megatron")

    def router(number, freq, layers=6):
        return NS(layer_number=number, config=NS(num_layers=layers, moe_layer_freq=freq))

    assert mg.moe_layer_index(router(5, 2), local=0) == 2  # MoE layers 1, 3 before 5
    assert mg.moe_layer_index(router(4, 1), local=1) == 3  # a later stage's first router
    assert mg.moe_layer_index(router(3, [0, 1, 1, 0], layers=4), local=0) == 1
    assert mg.moe_layer_index(NS(layer_number=None), local=7) == 7  # built on its own
    # multi-token-prediction layers are numbered past the decoder: one index each
    assert [mg.moe_layer_index(router(n, 2), local=0) for n in (7, 8)] == [3, 4]


def test_megatron_lms_last_saves_are_told_from_its_globals(monkeypatch):
    """megatron_lm_stops_at reads Megatron-LM's globals (a stand-in module here: Megatron-LM
    is not a package; benchmarks/megatron_upstream/lm_checkpointing.py runs the real one):
    the iterations after whose save its train() exits, and a caught exit signal."""
    import types
    from types import SimpleNamespace as NS

    from moepec.integrations.megatron_switch import megatron_lm_stops_at

    assert not megatron_lm_stops_at(100)  # no Megatron-LM: a megatron-core loop
    lm = types.ModuleType("megatron.training.global_vars")
    lm._GLOBAL_ARGS = NS(train_iters=100, exit_interval=None, exit_signal_handler=True,
                         exit_duration_in_mins=None, phase_transition_iterations=[40])
    lm._GLOBAL_SIGNAL_HANDLER = NS(_signal_received=False)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", lm)
    assert [i for i in (10, 40, 99, 100, 101) if megatron_lm_stops_at(i)] == [40, 100, 101]
    assert not megatron_lm_stops_at(-1)  # a folder name without an iteration
    lm._GLOBAL_ARGS.exit_interval = 30
    assert [i for i in (10, 30, 60, 61) if megatron_lm_stops_at(i)] == [30, 60]
    lm._GLOBAL_SIGNAL_HANDLER._signal_received = True  # caught on this rank
    assert megatron_lm_stops_at(11)
    lm._GLOBAL_ARGS.exit_signal_handler = False  # a handler Megatron-LM does not act on
    assert not megatron_lm_stops_at(11)
    training = types.ModuleType("megatron.training.training")
    training._TRAIN_START_TIME = 0.0  # started long ago: past any duration
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    assert not megatron_lm_stops_at(11)
    lm._GLOBAL_ARGS.exit_duration_in_mins = 5
    assert megatron_lm_stops_at(11)


def test_expert_identity_from_the_sharded_state_dict():
    mg = pytest.importorskip("moepec.integrations.megatron")
    t = torch.zeros(8, 16)
    seq = ShardedTensor.from_rank_offsets(  # SequentialMLP: layers stacked, expert axis 1
        "decoder.layers.mlp.experts.experts.linear_fc1.weight", t, (0, 1, 2), (1, 3, 4),
        prepend_axis_num=2)
    opt = ShardedTensor.from_rank_offsets(  # its Adam moment: the same expert
        "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight", t,
        (0, 1, 2), (1, 3, 4), prepend_axis_num=2)
    single = ShardedTensor.from_rank_offsets(  # singleton_local_shards: layers not stacked
        "decoder.layers.1.mlp.experts.experts.3.linear_fc1.weight", t)
    shared = ShardedTensor.from_rank_offsets(
        "decoder.layers.mlp.shared_experts.linear_fc1.weight", t, (0, 1, 2),
        prepend_axis_num=1)
    assert mg.expert_unit(seq) == ("decoder.layers.mlp@(1,)", 3)
    assert mg.expert_unit(opt) == mg.expert_unit(seq)
    assert mg.expert_unit(single) == ("decoder.layers.1.mlp.experts@()", 3)
    assert mg.expert_unit(shared) is None
    alone = ShardedTensor.from_rank_offsets(  # a SequentialMLP on its own: prefix "0."
        "0.experts.linear_fc1.weight", t, (0, 5, 8), prepend_axis_num=1)
    assert mg.expert_unit(alone) == ("0@()", 5)
    grouped = ShardedTensor.from_rank_offsets(  # GroupedMLP in a decoder: 2 per shard
        "decoder.layers.mlp.experts.linear_fc1.weight", torch.zeros(2, 4), (0, 1, 2),
        (1, 1, 4), prepend_axis_num=1)
    with pytest.raises(CheckpointingException, match="several experts in one shard"):
        mg.expert_unit(grouped)
    # GroupedMLP's real keys are SequentialMLP's; its expert axis is the first local one
    real = ShardedTensor.from_rank_offsets(  # [layers] + [local experts, out, in]
        "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight",
        torch.zeros(1, 8, 16), (0, 1, 2), (1, 3, 4), prepend_axis_num=1)
    assert mg.expert_unit(real) == ("decoder.layers.mlp@(1,)", 3)
    real_extra = ShardedObject("decoder.layers.mlp.experts.experts.linear_fc1._extra_state",
                               None, (2, 4), (1, 3))
    assert mg.object_unit(real_extra) == mg.expert_unit(real)
    stacked = ShardedTensor.from_rank_offsets(  # two local experts in the shard
        "decoder.layers.mlp.experts.experts.linear_fc2.weight", torch.zeros(2, 16, 8),
        (0, 1, 2), (1, 1, 2), prepend_axis_num=1)
    with pytest.raises(CheckpointingException, match="singleton_local_shards"):
        mg.expert_unit(stacked)  # whole, it is refused; the door cuts it first
    _cut_per_expert(stacked, mg)
    extra = ShardedObject("decoder.layers.mlp.experts.experts.linear_fc1._extra_state", None,
                          (2, 4), (1, 3))
    attn = ShardedObject("decoder.layers.self_attention.linear_proj._extra_state", None,
                         (2,), (1,))
    assert mg.object_unit(extra) == mg.expert_unit(seq) and mg.object_unit(attn) is None
    single_extra = ShardedObject(
        "decoder.layers.1.mlp.experts.experts.3.linear_fc1._extra_state", None, (1,), (0,))
    assert mg.object_unit(single_extra) == mg.expert_unit(single)
    bucket = ShardedTensor.from_rank_offsets(
        "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32).param",
        torch.zeros(4))
    with pytest.raises(CheckpointingException, match="fully_reshardable"):
        mg._main_shards({"optimizer": bucket})


def _cut_per_expert(stacked: ShardedTensor, mg) -> None:
    """A shard of two experts (GroupedMLP without singleton shards) as the door reads
    it: two shards of one expert each, views of its data, the global shape kept; a load
    into the pieces fills the stacked tensor, which is what the load returns."""
    from moepec.integrations.megatron_keys import split_experts
    from moepec.integrations.megatron_ram import Pieces

    a, b = split_experts(stacked)
    assert (a.local_shape, a.global_offset, b.global_offset) == (
        (1, 16, 8), (1, 2, 0, 0), (1, 3, 0, 0))
    assert a.global_shape == stacked.global_shape and a.axis_fragmentations == (2, 4, 1, 1)
    assert [mg.expert_unit(a), mg.expert_unit(b)] == [("decoder.layers.mlp@(1,)", e)
                                                      for e in (2, 3)]
    pieces = Pieces({"w": stacked})
    assert len(pieces.by_key) == 2 and split_experts(a) == [a]
    loaded = {}
    for i, p in enumerate(pieces.by_key.values()):
        loaded[id(p)] = p.data.fill_(i + 1)  # filled in place, as the load does
    assert pieces.whole(stacked, loaded) is stacked.data
    assert stacked.data[:, 0, 0].tolist() == [1.0, 2.0]
    loaded = {id(p): torch.full((1, 16, 8), 5.0) for p in pieces.by_key.values()}
    assert pieces.whole(stacked, loaded).shape == (2, 16, 8)  # not in place: joined
    flat = ShardedTensor.from_rank_offsets(  # no flattened shard in megatron-core 0.16
        stacked.key, torch.zeros(2, 16, 8), (0, 1, 2), (1, 1, 2), prepend_axis_num=1)
    object.__setattr__(flat, "flattened_range", slice(0, 200))
    assert split_experts(flat) == [flat]  # cut across experts: not split, refused
    with pytest.raises(CheckpointingException, match="cannot be cut per expert"):
        mg.expert_unit(flat)


@pytest.mark.slow
def test_ep1_singleton_keys_partial_saves_load_stitched_bit_exact(tmp_path):
    # metadata={'singleton_local_shards': True}: one key per (layer, expert)
    proc = torchrun(1, "save", tmp_path, singleton=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [line] = ok_lines(proc)  # K=1 of 4 from c = 1 on: per layer one expert each from
    # the saves at steps 10 and 20, and one (not saved since) from the full save at 0
    assert line.startswith("rank 0 OK iter_0000030 6 stale from steps [0, 0, 10, 10, 20, "
                           "20] of 8 PLT "), line
    assert float(line.rsplit(" ", 1)[1]) > 0  # tokens routed after those copies: lost
    res = verify_root(str(tmp_path))
    assert res.ok, res.lines()
    assert res.needs["iter_0000030"] == ["iter_0000000", "iter_0000010", "iter_0000020"]
    # K=1 of 4: every save after the first writes 1 expert per layer (2 layers).
    assert [len(_saved(tmp_path, i)) for i in (0, 10, 20, 30)] == [8, 2, 2, 2]
    # Deleting a folder a view needs is what verify warns about.
    for p in sorted((tmp_path / "iter_0000010").rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    (tmp_path / "iter_0000010").rmdir()
    res = verify_root(str(tmp_path))
    assert not res.ok and any("iter_0000030: needs iter_0000010" in b for b in res.broken)


def _saved(root: Path, it: int) -> list:
    import json
    with open(root / f"iter_{it:07d}" / "moepec.json") as f:
        return json.load(f)["experts_saved"]


@pytest.mark.slow
def test_ep2_saves_a_killed_save_and_the_resume(tmp_path):
    proc = torchrun(2, "save-crash", tmp_path)  # four saves, a load, a killed save
    assert proc.returncode != 0
    assert len(ok_lines(proc)) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    folder = tmp_path / "iter_0000040"
    assert folder.is_dir() and not (folder / "moepec.json").exists()
    assert not (folder / "metadata.json").exists()  # Megatron's own mark: not complete
    res = verify_root(str(tmp_path))
    assert res.ok and res.uncommitted == ["iter_0000040"], res.lines()
    resumed = torchrun(2, "resume", tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert ok_lines(resumed) == ok_lines(proc)  # the same stitched state, bit-exact
    assert "PARENT iter_0000030" in resumed.stdout  # the killed save is not a parent
    assert verify_root(str(tmp_path)).ok
    assert resumed.stdout.count("OBJECTS OK") == 2  # BytesIO objects; one rank's error
    assert resumed.stdout.count("PIPELINE ROUTING OK") == 2  # PP 2: layers L 2, 3 on rank 1
    # complete_next_save on one rank: that save holds every expert, loads bit for bit
    assert resumed.stdout.count("FINAL OK") == 2, resumed.stdout[-3000:]
    # Saved at EP 2, loaded at EP 1 (one rank): equal to Megatron's own resharding of a
    # torch_dist save of the same state, with the PLT of the EP 2 load.
    moved = torchrun(1, "reshard", tmp_path)
    assert moved.returncode == 0, moved.stdout[-3000:] + moved.stderr[-3000:]
    [line] = [x for x in moved.stdout.splitlines() if x.startswith("RESHARD OK")]
    assert line.endswith(ok_lines(proc)[0].rsplit(" ", 1)[1]), (line, ok_lines(proc))
    # The way back: `moepec materialize` writes the stitched view as a torch_dist
    # checkpoint, which stock Megatron (a process that never imports moepec) loads at
    # EP 1 equal, bit for bit, to the torch_dist save of the same state (which equals a
    # moepec load of the folder: the resume and reshard phases above). The CLI runs
    # behind the CPU shims: Megatron's torch_dist save calls CUDA.
    out = tmp_path / "stock" / "iter_0000030"
    shimmed = ("import sys; sys.path.insert(0, 'tests'); import megatron_shims; "
               "megatron_shims.install(); from moepec.cli.main import main; "
               "sys.exit(main(sys.argv[1:]))")
    cli = subprocess.run([sys.executable, "-c", shimmed, "materialize",
                          str(tmp_path / "iter_0000030"), str(out)], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=240)
    assert cli.returncode == 0 and "iter_0000030" in cli.stdout, cli.stdout + cli.stderr
    stock = torchrun(1, None, tmp_path, worker=STOCK, args=[str(out),
                                                            str(tmp_path / "ref" / "iter_0000030")])
    assert stock.returncode == 0, stock.stdout[-3000:] + stock.stderr[-3000:]
    assert stock.stdout.count(" STOCK OK ") == 1, stock.stdout


@pytest.mark.slow
def test_loads_torch_dist_refuses_or_reports_the_same_with_moepec(tmp_path):
    """Each load of tests/megatron_strict.py on a torch_dist folder and a moepec folder of
    the same state: another global shape (rigid: raised on both, naming the key and both
    shapes; allow_shape_mismatch: the same values, zeros past the saved tensor), and
    unexpected, missing and exact keys under every StrictHandling mode (the same
    exception, or the same values, returned keys and warnings). A save without experts
    warns once, on rank 0 (a UserWarning); those saves and their exact loads log nothing,
    DCP's DEBUG trace included (Megatron's test_exact_load_handling asserts an empty
    caplog over them). The torch_dist switch (use_for_torch_dist): Megatron's default
    save, as Megatron-LM's save_checkpoint asks for it (with the fully parallel and
    constant-structure wrappers, sync and async), writes a moepec folder of K = 1 of 4
    experts that a load without a strategy stitches back bit for bit; switched off, the
    default save is torch_dist again."""
    proc = torchrun(2, None, tmp_path, worker=STRICT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(x for x in proc.stdout.splitlines() if "STRICT OK" in x) == [
        "rank 0 STRICT OK 29", "rank 1 STRICT OK 29"]


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
def test_transformer_engine_grouped_experts_save_k_of_n_and_load_bit_exact(tmp_path, ep):
    """TEGroupedMLP (swiglu, FP8 extra state), its sharded state dict Megatron's own
    (TEGroupedLinear._sharded_state_dict_grouped, under the TE stand-in of
    tests/te_standin.py, in the worker's processes only): the worker checks that each
    (layer, expert) is found once with its 11 shards (fc1's swiglu halves of weight<i>,
    fc2's weight<i>, their Adam moments, both _extra_state), and that the stitched load
    equals the documented rotation bit for bit (weights, moments, each expert's FP8
    scales); here, that each save after the first wrote one expert per layer, whole."""
    proc = torchrun(ep, None, tmp_path, worker=TE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tensors = {1: 169, 2: 113}[ep]  # this rank's weights, moments and FP8 scales
    assert sorted(x for x in proc.stdout.splitlines() if " TE OK " in x) == sorted(
        f"rank {r} TE OK singleton={s} {tensors} tensors 6 stale of 8"
        for r in range(ep) for s in (False, True)), proc.stdout[-3000:]
    for layout in ("stacked", "single"):
        _one_expert_per_layer_whole(tmp_path / layout)


def _one_expert_per_layer_whole(root: Path) -> None:
    """The three saves of tests/megatron_layouts.py in ``root``: 8 experts, then K = 1
    per layer (2 layers), each written expert whole (its 11 shards); the non-expert
    shards every time."""
    written = []
    for it in (0, 10, 20):
        m = json.loads((root / f"iter_{it:07d}" / "moepec.json").read_text())
        units = Counter(tuple(m["experts"][k]) for k in m["items"] if k in m["experts"])
        assert sorted(units) == sorted(tuple(u) for u in m["experts_saved"])
        assert set(units.values()) == {11}, units
        written.append((len(units), len(m["items"]) - 11 * len(units)))
    assert [n for n, _ in written] == [8, 2, 2] and len({r for _, r in written}) == 1


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
def test_legacy_grouped_experts_save_k_of_n_and_load_bit_exact(tmp_path, ep):
    """Megatron's legacy GroupedMLP (swiglu; grouped_gemm the stand-in of
    tests/grouped_gemm_standin.py, in the worker's processes only, a forward and backward
    run on it): with singleton_local_shards the worker checks that each (layer, expert)
    is found once with its 11 shards (weight1's swiglu halves, weight2, their Adam
    moments, both placeholder _extra_state) and that the stitched load equals the
    documented rotation bit for bit; the same without it (Megatron-LM's own setting),
    where a rank's experts share one shard that the door cuts per expert; here, that
    each save after the first wrote one expert per layer, whole, in both layouts. At
    EP 2, the stacked layout across EP too: EP 1 loads the EP 2 folder, and EP 2 the
    EP 1 model's save, equal to every rank's oracle."""
    proc = torchrun(ep, None, tmp_path, worker=GROUPED)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tensors = {1: 105, 2: 81}[ep]  # this rank's weights and moments, experts cut apart
    assert sorted(x for x in proc.stdout.splitlines() if " GROUPED " in x) == sorted(
        [f"rank {r} GROUPED OK singleton={s} {tensors} tensors 6 stale of 8"
         for r in range(ep) for s in (False, True)]
        + [f"rank {r} GROUPED EP OK 2 -> 1 -> 2" for r in range(ep) if ep == 2]
    ), proc.stdout[-3000:]
    for layout in ("single", "stacked"):
        _one_expert_per_layer_whole(tmp_path / layout)


def test_an_untested_megatron_core_version_warns_once(monkeypatch, caplog):
    import importlib.metadata

    from moepec.integrations import megatron_checks as mc

    assert mc.version_warning("0.16.1") is None
    line = mc.version_warning("0.17.0")
    assert "0.17.0" in line and "megatron-core==0.16.1" in line and "\n" not in line
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.16.7")
    mc.check_version.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="moepec.integrations.megatron_checks"):
            mc.check_version()
            mc.check_version()
    finally:
        mc.check_version.cache_clear()
    assert [r.getMessage() for r in caplog.records] == [mc.version_warning("0.16.7")]
