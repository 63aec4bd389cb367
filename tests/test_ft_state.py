"""What replica groups need without torchft: the manager's live state round trip, the
--ft-* flags, the data shards of groups (the torchft end to end is tests/test_ft.py)."""

from __future__ import annotations

import argparse

import pytest
import torch

from moepec import CheckpointConfig, CheckpointManager
from moepec.errors import ConfigError
from tests.toy import Counter, make, run_loop, train_step


def _manager(tmp_path, name: str, events: list):
    model, opt, sched = make(0, "stacked", 4)
    cfg = CheckpointConfig(path=str(tmp_path / name), interval=2, k_persist=1, k_snapshot=2,
                           selection="load_aware", async_snapshot=False, async_persist=False,
                           ram_dir=None)
    manager = CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": Counter()},
                                on_checkpoint=events.append)
    return manager, model, opt, sched


def test_a_healed_manager_continues_the_live_ones_checkpoint_schedule(tmp_path):
    live_events, healed_events = [], []
    live, model, opt, sched = _manager(tmp_path, "live", live_events)
    gen = torch.Generator().manual_seed(1)
    run_loop(live, model, opt, sched, Counter(), gen, 0, 7)  # checkpoints at 1, 3, 5
    _, counts = train_step(model, opt, sched, gen)
    live.observe_routing(counts)  # counts since the last checkpoint travel too
    healed, h_model, h_opt, _ = _manager(tmp_path, "healed", healed_events)
    state = live.live_state()
    h_model.load_state_dict(model.state_dict())
    h_opt.load_state_dict(opt.state_dict())
    healed.load_live_state(state)
    assert healed.live_state() == state
    assert (healed.k_persist, healed.k_snapshot) == (live.k_persist, live.k_snapshot)
    # The live group's next checkpoint is partial; the healed group's own root holds no
    # expert yet, so its first checkpoint there is a full one (storage coverage is the
    # root's, not the peer's).
    for mgr in (live, healed):
        mgr.save(7)
    assert not live_events[-1].full and healed_events[-1].full
    assert live.live_state()["index"] == healed.live_state()["index"]
    for mgr in (live, healed):
        mgr.close()


def _ft_args(**kw) -> argparse.Namespace:
    d = dict(ft_lighthouse=None, ft_groups=None, ft_group=None, ft_timeout=10.0,
             ft_quorum_timeout=60.0, ft_transport="http", ft_no_digests=False, ft_spares=10,
             ft_checkpoints="striped")
    return argparse.Namespace(**(d | kw))


def test_ft_flags_map_onto_one_config_and_name_the_fix():
    from moepec.cli.replicas import ft_config_from_args

    assert ft_config_from_args(_ft_args()) is None
    cfg = ft_config_from_args(_ft_args(ft_lighthouse="http://h:1", ft_groups=2, ft_group=1))
    assert (cfg.lighthouse, cfg.groups, cfg.group, str(cfg.transport)) == ("http://h:1", 2, 1,
                                                                          "http")
    with pytest.raises(ConfigError, match="--ft-lighthouse"):
        ft_config_from_args(_ft_args(ft_groups=2, ft_group=0))
    with pytest.raises(ConfigError, match="--ft-groups G and --ft-group I"):
        ft_config_from_args(_ft_args(ft_lighthouse="http://h:1"))
    with pytest.raises(ConfigError, match=r"group must be in \[0, 2\)"):
        ft_config_from_args(_ft_args(ft_lighthouse="http://h:1", ft_groups=2, ft_group=2))
    with pytest.raises(ConfigError, match="--ft-spares must be >= 0"):
        ft_config_from_args(_ft_args(ft_lighthouse="h", ft_groups=2, ft_group=0, ft_spares=-1))
    with pytest.raises(ConfigError, match="ft transport"):
        ft_config_from_args(_ft_args(ft_lighthouse="h", ft_groups=2, ft_group=0,
                                     ft_transport="smoke"))
    assert str(cfg.checkpoints) == "striped"
    with pytest.raises(ConfigError, match="ft checkpoints"):
        ft_config_from_args(_ft_args(ft_lighthouse="h", ft_groups=2, ft_group=0,
                                     ft_checkpoints="mirror"))


def test_groups_split_every_global_batch_between_all_their_ranks():
    from moepec.train.config import FtConfig, TrainConfig
    from moepec.train.dist import DistInfo
    from moepec.train.setup import data_shard

    info = DistInfo(rank=1, world_size=2, local_rank=1, initialized_here=False)
    ft = FtConfig(lighthouse="h", groups=3, group=2)
    assert data_shard(TrainConfig(config="tiny", batch_size=12, ft=ft), info) == (5, 6)
    assert data_shard(TrainConfig(config="tiny", batch_size=12), info) == (1, 2)
    with pytest.raises(ConfigError, match="--fsdp"):
        TrainConfig(config="tiny", ft=ft, fsdp=True)


def test_a_peer_watch_reports_a_silent_rank_once_and_not_a_finished_one():
    """moepec.train.liveness.PeerWatch on an in-process store: rank 0 watches ranks 1 and
    2; rank 1 ends its run (done) first, rank 2 stops beating later without ending it: only
    rank 2 is frozen (were rank 1's end taken for a freeze, rank 1 would come first). The
    silence limit (3 s) is 60 beats: a beating thread that a busy machine stalls for a
    second is not taken for frozen (a 1 s limit could flag rank 1 before its end)."""
    import threading
    import time

    import torch.distributed as dist

    from moepec.train.liveness import PeerWatch

    LIMIT_S = 3.0
    store, frozen, seen = dist.HashStore(), [], threading.Event()

    def on_frozen(rank: int, silent_s: float) -> None:
        frozen.append((rank, silent_s))
        seen.set()

    watcher = PeerWatch(store, 0, 3, LIMIT_S, on_frozen, interval_s=0.05)
    finished = PeerWatch(store, 1, 3, LIMIT_S, lambda *_: None, interval_s=0.05)
    watcher.begin()
    finished.begin()
    time.sleep(0.1)
    finished.close()  # marks rank 1 done: its silence from now on is not a freeze
    t_end = time.monotonic() + 0.6
    while time.monotonic() < t_end:  # rank 2 beats a while longer, then freezes
        store.add("beat/2", 1)
        time.sleep(0.05)
    assert seen.wait(30)
    watcher.close()
    assert [r for r, _ in frozen] == [2] and frozen[0][1] >= LIMIT_S
