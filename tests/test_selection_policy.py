"""A user-supplied selection policy (moepec.register_selection) drives both front ends:
which experts each checkpoint of a CheckpointManager and each flat save writes, a restore
that stitches bit for bit and continues the policy's own state, clear errors for a wrong
answer, a state that is not JSON, an unknown or unregistered name."""

from __future__ import annotations

import logging
from dataclasses import asdict

import pytest
import torch

import moepec
from moepec import CheckpointConfig, CheckpointManager, ConfigError, SelectionPolicy
from moepec.errors import ManifestError
from moepec.flat import FlatFrontEnd
from moepec.manager.schedule import ExpertSchedule
from moepec.policy.plt import PLTLedger
from moepec.policy.selection import Selector, select_two_tier
from moepec.store.meta import meta_from_json
from tests.test_engine import N_EXPERTS, check_restore, committed_manifests, run
from tests.test_flat_front import UNITS, per_layer
from tests.test_flat_front import save as flat_save
from tests.toy import Counter, make, run_loop


class ReverseRoundRobin(SelectionPolicy):
    """Walks down through the experts (layer m starts at N-1-m); its state: the next
    expert to take and how many checkpoints it has seen (to prove the state travels)."""

    def initial_state(self, layer, n_experts):
        return {"next": (n_experts - 1 - layer) % n_experts, "seen": 0}

    def select(self, ctx):
        out, e = [], ctx.state["next"]
        while len(out) < ctx.k:
            if e not in ctx.exclude:
                out.append(e)
            e = (e - 1) % ctx.n_experts
        return out

    def on_saved(self, state, *, layer, n_experts, experts, checkpoint):
        e = state["next"]
        for _ in range(n_experts):  # past the run of saved experts, walking down
            if e not in experts:
                break
            e = (e - 1) % n_experts
        return {"next": e, "seen": state["seen"] + 1}


@pytest.fixture
def rev(request):
    """A fresh registration of ReverseRoundRobin under a name of this test's own."""
    name = "rev-" + request.node.name.replace("[", "-").replace("]", "")[:40]
    moepec.register_selection(name, ReverseRoundRobin())
    yield name
    if name in moepec.selection_names():
        moepec.unregister_selection(name)


def manager_cfg(path, selection, **kw) -> CheckpointConfig:
    return CheckpointConfig(path=str(path), interval=2, k_persist=1, keep_last=10,
                            selection=selection, ram_dir=None, dynamic_k=False,
                            async_snapshot=False, async_persist=False, **kw)


def saved_in_order(manager) -> list[list[list[int]]]:
    return [m.meta.experts_saved for m in
            sorted(committed_manifests(manager).values(), key=lambda m: m.seq)]


# -- the manager ---------------------------------------------------------------------
@pytest.mark.parametrize("k_snapshot", [1, 2])
def test_a_user_policy_picks_each_checkpoints_experts_and_restore_is_exact(tmp_path, rev,
                                                                          k_snapshot):
    cfg = manager_cfg(tmp_path / "c", rev, k_snapshot=k_snapshot)
    manager, history, counts = run(cfg, steps=8, layout="stacked")
    # the first checkpoint is full; then layer 0 walks down from 3, layer 1 from 2
    assert saved_in_order(manager) == [[[0, 1, 2, 3]] * 2, [[3], [2]], [[2], [1]],
                                       [[1], [0]]]
    newest = max(committed_manifests(manager).values(), key=lambda m: m.seq).meta
    assert newest.selection == rev and newest.config["selection"] == rev
    assert newest.selectors["persist"]["policy_state"] == [{"next": 0, "seen": 4},
                                                           {"next": 3, "seen": 4}]
    report = check_restore(cfg, "stacked", manager, history, counts)
    assert report.plt > 0


def test_a_restored_run_continues_the_policys_state(tmp_path, rev):
    cfg = manager_cfg(tmp_path / "c", rev)
    first, _, _ = run(cfg, steps=8, layout="stacked")
    model, opt, sched = make(seed=3)
    counter = Counter()
    manager = CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter})
    assert manager.restore().step == 7
    run_loop(manager, model, opt, sched, counter, torch.Generator().manual_seed(2), 8, 4)
    manager.close()
    # a fresh state would start again at [[3], [2]]: the restored one goes on
    assert saved_in_order(manager)[-2:] == [[[0], [3]], [[3], [2]]]
    assert saved_in_order(first)[:4] == saved_in_order(manager)[:4]


def test_a_checkpoint_of_an_unregistered_policy_restores_under_the_configured_one(
        tmp_path, rev, caplog):
    """The fallback, not an error (policy.selection_policy says why): the config names
    the policy that runs; the saving one's state is dropped, with a warning naming the fix."""
    cfg = manager_cfg(tmp_path / "c", rev)
    manager, history, counts = run(cfg, steps=8, layout="stacked")
    manifest = max(committed_manifests(manager).values(), key=lambda m: m.seq)
    moepec.unregister_selection(rev)
    meta_from_json(asdict(manifest.meta), "m")  # still a valid manifest without the policy
    with caplog.at_level(logging.WARNING, logger="moepec.manager.schedule"):
        check_restore(manager_cfg(tmp_path / "c", "sequential"), "stacked", manager,
                      history, counts)
    warned = [r.getMessage() for r in caplog.records if "not registered" in r.getMessage()]
    assert len(warned) == 1 and f"moepec.register_selection('{rev}', policy)" in warned[0]


def test_manifest_validation_checks_the_policy_state_it_cannot_interpret(tmp_path, rev):
    cfg = manager_cfg(tmp_path / "c", rev)
    manager, _, _ = run(cfg, steps=4, layout="stacked")
    meta = asdict(max(committed_manifests(manager).values(), key=lambda m: m.seq).meta)
    meta["selectors"]["persist"]["policy_state"] = [{"next": 0}]  # one layer of two
    with pytest.raises(ManifestError, match="bookkeeping"):
        meta_from_json(meta, "m")
    meta["selectors"]["persist"]["policy_state"] = [None, None]
    meta["selectors"]["persist"]["policy"] = 7
    with pytest.raises(ManifestError, match="bookkeeping"):
        meta_from_json(meta, "m")


# -- the flat front end (Megatron's and DeepSpeed's doors) ----------------------------
def test_the_flat_front_end_uses_the_same_policy_and_continues_it_after_a_load(
        tmp_path, rev, one_rank):
    front = FlatFrontEnd(k_persist=1, selection=rev)
    got = [per_layer(flat_save(front, tmp_path, s)) for s in (0, 10, 20, 30)]
    assert got == [[[0, 1, 2, 3]] * 2, [[3], [2]], [[2], [1]], [[1], [0]]]
    fresh = FlatFrontEnd(k_persist=1, selection=rev)
    fresh.load(str(tmp_path), "iter_0000030", list(UNITS))
    assert per_layer(flat_save(fresh, tmp_path, 40)) == [[0], [3]]


# -- wrong answers and wrong state ----------------------------------------------------
def _register(name, policy):
    moepec.register_selection(name, policy, replace=True)
    return name


@pytest.mark.parametrize("answer, problem", [
    ([0], "1 experts instead of 2"),
    ([1, 1], "duplicates [1]"),
    ([0, 4], "out of range 0..3: [4]"),
    ([-1, 0], "out of range 0..3: [-1]"),
    ([1, 2, 3], "3 experts instead of 2"),
    (None, "not an iterable of int expert ids"),
    (["0", 1], "not an iterable of int expert ids"),
    ([True, 1], "not an iterable of int expert ids"),
])
def test_a_wrong_answer_raises_a_config_error_naming_the_policy(answer, problem):
    name = _register("bad-answer", lambda ctx: answer)
    try:
        with pytest.raises(ConfigError) as err:
            Selector.create([4], name).select(2, checkpoint_index=5)
        msg = str(err.value)
        assert "selection policy 'bad-answer'" in msg and "MoE layer 0 at checkpoint 5" in msg
        assert problem in msg and "ctx.candidates" in msg
    finally:
        moepec.unregister_selection(name)


def test_an_excluded_expert_is_refused_and_integer_scalars_are_taken():
    # the highest index first, ignoring the RAM tier's exclusions
    name = _register("highest", lambda ctx: range(ctx.n_experts - ctx.k, ctx.n_experts))
    try:
        sel = [Selector.create([4, 4], name) for _ in range(2)]
        assert select_two_tier(sel[0], sel[1], 1, 1) == ([(3,), (3,)], [(3,), (3,)])
        with pytest.raises(ConfigError, match=r"'highest'.*excluded experts \[3\]"):
            select_two_tier(sel[0], sel[1], 1, 2)
        _register(name, lambda ctx: torch.tensor(ctx.candidates[-ctx.k:]))
        assert select_two_tier(sel[0], sel[1], 1, 2) == ([(2, 3), (2, 3)], [(3,), (3,)])
    finally:
        moepec.unregister_selection(name)


def test_a_state_that_is_not_json_is_refused_and_changes_nothing(rev):
    class SetState(ReverseRoundRobin):
        def initial_state(self, layer, n_experts):
            return {1, 2}

    class BadUpdate(ReverseRoundRobin):
        def on_saved(self, state, **kw):
            return {"next": object()}

    _register("set-state", SetState())
    _register("bad-update", BadUpdate())
    try:
        with pytest.raises(ConfigError, match="'set-state': initial_state of MoE layer 0 "
                                              "is not JSON"):
            Selector.create([4], "set-state")
        sel = Selector.create([4, 4], "bad-update")
        before = sel.state_dict()
        with pytest.raises(ConfigError, match="'bad-update': the state on_saved returned"):
            sel.commit([(3,), (2,)], 1)
        assert sel.state_dict() == before
    finally:
        moepec.unregister_selection("set-state")
        moepec.unregister_selection("bad-update")


def test_the_policy_state_round_trips_and_a_switch_starts_afresh(rev):
    sel = Selector.create([4, 4], rev)
    sel.commit(sel.select(1, checkpoint_index=1), 1)
    copy = Selector.create([4, 4], rev)
    copy.load_state_dict(sel.state_dict())
    assert copy.state_dict() == sel.state_dict()
    assert copy.policy_state == [{"next": 2, "seen": 1}, {"next": 1, "seen": 1}]
    sequential = Selector.create([4, 4])
    sequential.load_state_dict(sel.state_dict())  # another policy: its state is dropped
    assert "policy_state" not in sequential.state_dict()
    back = Selector.create([4, 4], rev)
    back.load_state_dict(sequential.state_dict())
    assert back.policy_state == [{"next": 3, "seen": 0}, {"next": 2, "seen": 0}]
    assert back.last_saved == sel.last_saved


# -- names -----------------------------------------------------------------------------
def test_an_unknown_name_lists_the_registered_ones_and_the_fix(rev):
    for make_it in (lambda: CheckpointConfig(path="x", selection="nope"),
                    lambda: FlatFrontEnd(selection="nope")):
        with pytest.raises(ConfigError) as err:
            make_it()
        msg = str(err.value)
        assert f"unknown selection 'nope'; choose one of sequential, load_aware, {rev}" in msg
        assert "moepec.register_selection('nope', policy)" in msg


def test_a_policy_unregistered_after_its_config_is_refused_when_the_schedule_starts(rev):
    cfg = CheckpointConfig(path="x", selection=rev)
    moepec.unregister_selection(rev)
    with pytest.raises(ConfigError, match=f"unknown selection policy '{rev}'.*register_sel"):
        ExpertSchedule((4, 4), cfg)
    schedule = ExpertSchedule((4, 4), CheckpointConfig(path="x"))
    fields = schedule.meta_fields()
    fields["selectors"]["persist"]["policy"] = rev
    schedule.resume_from(fields, PLTLedger.create([4, 4]))  # a switch: allowed, warned


def test_the_registry_refuses_what_it_cannot_keep(rev):
    policy = ReverseRoundRobin()
    with pytest.raises(ConfigError, match="built-in"):
        moepec.register_selection("sequential", policy)
    with pytest.raises(ConfigError, match="letters, digits"):
        moepec.register_selection("two words", policy)
    with pytest.raises(ConfigError, match="an instance of ReverseRoundRobin"):
        moepec.register_selection("cls", ReverseRoundRobin)
    with pytest.raises(ConfigError, match="must be a moepec.SelectionPolicy"):
        moepec.register_selection("num", 3)
    with pytest.raises(ConfigError, match="already registered.*replace=True"):
        moepec.register_selection(rev, policy)
    fn = ReverseRoundRobin().select
    _register("fn", fn)
    moepec.register_selection("fn", fn)  # the same function again: a no-op
    moepec.unregister_selection("fn")
    with pytest.raises(ConfigError, match="no user selection policy 'fn'"):
        moepec.unregister_selection("fn")
    assert moepec.selection_names()[:2] == ("sequential", "load_aware")
    assert rev in moepec.selection_names() and N_EXPERTS == 4
