"""PEC engine: restore gives every key exactly as it was at its last committed save."""

from __future__ import annotations

import random
import uuid

import fsspec
import pytest
import torch

from moepec import CheckpointConfig, CheckpointManager
from moepec.keys import parse_key
from tests.toy import Counter, full_state, make, run_loop, train_step

N_EXPERTS = 4


def _url(kind: str, tmp_path) -> str:
    if kind == "memory":
        return f"memory://moepec-test-{uuid.uuid4().hex}"
    return str(tmp_path / "ckpt")


def run(cfg: CheckpointConfig, steps: int, layout: str, seed: int = 0, data_seed: int = 1):
    """Train the toy model with checkpointing; return what a test needs to check restore."""
    model, opt, sched = make(seed, layout, N_EXPERTS)
    counter = Counter()
    gen = torch.Generator().manual_seed(data_seed)
    manager = CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter})
    history, counts_hist = {}, {}
    observe = manager.observe_routing

    def record(counts):  # keep the routing history for the independent PLT reference
        counts_hist[len(counts_hist)] = [c.tolist() for c in counts]
        observe(counts)

    def save(step):
        history[step] = (full_state(model, opt), sched.state_dict(), counter.position)

    manager.observe_routing = record
    run_loop(manager, model, opt, sched, counter, gen, 0, steps, on_save=save)
    manager.close()
    return manager, history, counts_hist


def committed_manifests(manager):
    st = manager._storage
    return {n: st.read_manifest(n) for n in st.committed()}


def saved_steps(manifests, layer, expert, part):
    """Steps (ascending) of committed checkpoints holding a copy of an expert unit."""
    steps = []
    for m in manifests.values():
        if any(parse_key(k).layer == layer and parse_key(k).expert == expert
               and parse_key(k).part == part for k in m.keys if parse_key(k).is_expert):
            steps.append(m.step)
    return sorted(steps)


def expert_view(tensor, layout, e):
    return tensor[e] if layout == "stacked" else tensor


def check_restore(cfg, layout, manager, history, counts_hist):
    """Restore into a fresh model and compare with the recorded history, bit for bit."""
    manifests = committed_manifests(manager)
    # the newest lineage is the whole history here (no faults): base = newest commit
    base_step = max(m.step for m in manifests.values())
    model, opt, sched = make(seed=99, layout=layout, n_experts=N_EXPERTS)
    counter = Counter()
    m2 = CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter})
    report = m2.restore()
    assert report is not None and report.step == base_step
    restored = full_state(model, opt)
    base_state, base_sched, base_pos = history[base_step]
    assert counter.position == base_pos
    assert sched.state_dict()["last_epoch"] == base_sched["last_epoch"]
    emap = m2._emap
    expert_names = set(emap.owner)
    lost_ref = [[0] * N_EXPERTS for _ in emap.layers]
    for key, value in restored.items():
        _, rest = key.split("/", 1)
        pname = rest.rsplit("/", 1)[0] if key.startswith("optim/") else rest
        if pname not in expert_names or key.endswith("/step"):
            assert torch.equal(value, base_state[key]), key
            continue
        layer_i, owner_e = emap.owner[pname]
        layer = emap.layers[layer_i]
        part = "optim" if key.startswith("optim/") else "model"
        for e in range(layer.n_experts) if owner_e is None else [owner_e]:
            steps = [s for s in saved_steps(manifests, layer_i, e, part) if s <= base_step]
            assert steps, f"expert {e} of layer {layer_i} ({part}) was never saved"
            src = steps[-1]
            expect = expert_view(history[src][0][key], layer.layout, e)
            got = expert_view(value, layer.layout, e)
            assert torch.equal(got, expect), (key, e, src)
            if part == "model" and (layout != "modules" or pname.endswith("w1")):
                # independent PLT reference: assignments to e in steps (src, base]
                lost_ref[layer_i][e] = sum(counts_hist[s][layer_i][e]
                                           for s in range(src + 1, base_step + 1))
    assert report.lost == lost_ref
    totals = [sum(sum(counts_hist[s][i]) for s in range(base_step + 1))
              for i in range(len(emap.layers))]
    plt_ref = sum(sum(lost_ref[i]) / totals[i] for i in range(len(totals))) / len(totals)
    assert report.plt == pytest.approx(plt_ref, rel=1e-12, abs=1e-15)
    # the restored optimizer can keep training
    gen = torch.Generator().manual_seed(5)
    train_step(model, opt, sched, gen)
    opt.step()
    return report


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("layout", ["stacked", "modules"])
def test_random_save_sequences_restore_exactly(tmp_path, seed, layout):
    rng = random.Random(seed * 7 + (layout == "modules"))
    k = rng.randint(1, N_EXPERTS)
    cfg = CheckpointConfig(
        path=_url(rng.choice(["local", "memory"]), tmp_path),
        interval=rng.randint(1, 3), k_persist=k, k_snapshot=rng.randint(k, N_EXPERTS),
        selection=rng.choice(["sequential", "load_aware"]),
        pec_scope=rng.choice(["all", "all", "optimizer", "weights"]),
        full_every=rng.choice([0, 0, 3]), keep_last=rng.randint(1, 3),
        async_snapshot=rng.random() < 0.5, async_persist=rng.random() < 0.5)
    manager, history, counts = run(cfg, steps=rng.randint(8, 14), layout=layout, seed=seed)
    check_restore(cfg, layout, manager, history, counts)


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_k1_sequential_partial_checkpoints(tmp_path, kind):
    cfg = CheckpointConfig(path=_url(kind, tmp_path), interval=2, k_persist=1, keep_last=5)
    manager, history, counts = run(cfg, steps=10, layout="stacked")
    manifests = committed_manifests(manager)
    ordered = sorted(manifests.values(), key=lambda m: m.seq)
    assert ordered[0].meta.full and not any(m.meta.full for m in ordered[1:])
    # staggered round robin after the first (full) checkpoint: layer m saves (m + c) mod N
    for c, m in enumerate(ordered[1:]):
        assert m.meta.experts_saved == [[(layer + c) % N_EXPERTS] for layer in range(2)]
    report = check_restore(cfg, "stacked", manager, history, counts)
    assert report.plt > 0


def test_async_writes_same_checkpoints_as_sync(tmp_path):
    sums = []
    for mode in (False, True):
        cfg = CheckpointConfig(path=str(tmp_path / f"c{mode}"), interval=2, k_persist=1,
                               k_snapshot=2, async_snapshot=mode, async_persist=mode,
                               keep_last=10)
        manager, _, _ = run(cfg, steps=9, layout="stacked")
        sums.append([(m.step, {k: v.checksum for k, v in m.keys.items()
                                  if k != "objects/rng"})
                     for m in sorted(committed_manifests(manager).values(),
                                     key=lambda m: m.seq)])
    assert sums[0] == sums[1]
    assert len(sums[0]) == 4


def test_torn_state_never_mixes_steps(tmp_path):
    """A checkpoint started at step t while training continues restores exactly step t."""
    cfg = CheckpointConfig(path=str(tmp_path / "c"), interval=3, k_persist=4)
    manager, history, counts = run(cfg, steps=12, layout="stacked")
    check_restore(cfg, "stacked", manager, history, counts)


def test_memory_filesystem_is_really_used():
    url = f"memory://moepec-test-{uuid.uuid4().hex}"
    cfg = CheckpointConfig(path=url, interval=2)
    run(cfg, steps=4, layout="stacked")
    fs = fsspec.filesystem("memory")
    names = [p.rsplit("/", 1)[-1] for p in fs.ls(url[len("memory://"):], detail=False)]
    assert any(n.startswith("ckpt-") for n in names)
