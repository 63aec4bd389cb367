"""Expert parallelism: an EP run computes what the data-parallel run computes.

Spawned gloo processes with a file rendezvous (no ports). Each spawn trains the same
runs with ep=1 and ep=2 inside one process group, so the data-parallel reference
shares the ranks, seeds and data shards of the EP run.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist

from moepec.cli.main import main
from moepec.errors import ConfigError
from moepec.models import GPTMoE, get_config
from moepec.models.parallel import (
    ExpertParallel,
    global_expert_ids,
    init_expert_parallel,
)
from moepec.train.steps import evaluate
from moepec.train.trainer import TrainConfig, train
from tests.spawning import start_processes

EP = 2
# stacked with top-1, modules with top-2: both layouts, both combine paths. The default
# capacity factor drops assignments and the aux loss is on: EP must match DP anyway.
LAYOUTS = {"stacked": {"top_k": 1}, "modules": {"top_k": 2}}
# A small clip keeps clipping active, so its (logged) norm must cover all experts.
RUN = dict(config="tiny", progress=False, threads=1, steps=4, batch_size=8, seed=5,
           eval_batches=2, eval_interval=2, warmup=1, lr=1e-2, grad_clip=0.1,
           log_interval=1, return_state=True)
TOL = dict(rtol=1e-5, atol=1e-5)


def _expert_id(name: str) -> tuple[str, int, str] | None:
    """(layer prefix, local index, leaf) of a modules-layout expert parameter name."""
    parts = name.split(".")
    if "experts" not in parts or len(parts) < parts.index("experts") + 3:
        return None
    i = parts.index("experts")
    return ".".join(parts[:i]), int(parts[i + 1]), ".".join(parts[i + 2:])


def _to_global(state: dict[str, torch.Tensor], ep_rank: int, n_local: int
               ) -> dict[str, torch.Tensor]:
    """Local names -> global names; stacked tensors become {name}#{global id} slices."""
    out = {}
    for name, value in state.items():
        mod = _expert_id(name)
        if mod is not None:
            prefix, i, leaf = mod
            out[f"{prefix}.experts.{ep_rank * n_local + i}.{leaf}"] = value
        elif ".experts." in name:
            for i in range(value.shape[0]):
                out[f"{name}#{ep_rank * n_local + i}"] = value[i]
        else:
            out[name] = value
    return out


def _global_id(key: str) -> int | None:
    """Global expert id of a key of :func:`_to_global`'s result; None: not an expert."""
    if "#" in key:
        return int(key.rsplit("#", 1)[1])
    mod = _expert_id(key)
    return None if mod is None else mod[1]


def _worker(rank: int, world: int, store: str, out_dir: str, cli_argv: list[str] | None) -> None:
    torch_dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                  world_size=world)
    torch.set_num_threads(1)
    try:
        out: dict = {"runs": {}}
        for layout, overrides in LAYOUTS.items():
            for ep in (1, EP):
                jsonl = Path(out_dir) / f"{layout}-ep{ep}.jsonl"  # rank 0 writes it
                result = train(TrainConfig(**RUN, ep=ep, log_jsonl=str(jsonl), model_overrides={
                    "expert_layout": layout, **overrides}))
                out["runs"][layout, ep] = {"losses": result.losses, "val": result.val_history,
                                           "state": result.model_state}
        if world == 4:  # torchtitan's layout: FSDP x EP on a (dp 2, ep 2) mesh
            jsonl = Path(out_dir) / "stacked-fsdp.jsonl"
            result = train(TrainConfig(**RUN, ep=EP, fsdp=True, log_jsonl=str(jsonl),
                                       model_overrides={"expert_layout": "stacked",
                                                        **LAYOUTS["stacked"]}))
            out["runs"]["stacked", "fsdp"] = {"losses": result.losses,
                                              "val": result.val_history,
                                              "state": result.model_state}  # full tensors
        # One forward on this rank's own tokens: logits, loss and routing stats.
        ep = init_expert_parallel(EP)
        cfg = get_config("tiny", top_k=2)
        torch.manual_seed(1)
        ref = GPTMoE(cfg)
        torch.manual_seed(1)
        model = GPTMoE(cfg, ep)
        gen = torch.Generator().manual_seed(100 + rank)
        idx = torch.randint(0, 256, (3, 32), generator=gen)
        a, b = ref(idx, idx), model(idx, idx)
        out["forward"] = {"ref_loss": a.loss.item(), "ep_loss": b.loss.item(),
                          "logits_err": (a.logits - b.logits).abs().max().item(),
                          "ref_assigned": [s.assigned for s in a.routing],
                          "ep_assigned": [s.assigned for s in b.routing]}
        # Uneven validation sets: rank 0 holds one batch more than the others.
        batches = [(idx, idx)] * (2 if rank == 0 else 1)
        out["eval"] = (evaluate(ref, batches), evaluate(model, batches))
        if cli_argv is not None:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                out["cli"] = (main(cli_argv), err.getvalue())
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        torch_dist.destroy_process_group()


def _grad_norms(path: Path) -> torch.Tensor:
    return torch.tensor([json.loads(line)["grad_norm"]
                         for line in path.read_text().splitlines()])


def _check(results: list[dict], out_dir: Path) -> None:
    n_local = 4 // EP
    for layout in LAYOUTS:
        dp_norms = _grad_norms(out_dir / f"{layout}-ep1.jsonl")
        assert len(dp_norms) == RUN["steps"] and bool((dp_norms > RUN["grad_clip"]).all())
        torch.testing.assert_close(_grad_norms(out_dir / f"{layout}-ep{EP}.jsonl"), dp_norms,
                                   **TOL)
        for rank, res in enumerate(results):
            dp, ep = res["runs"][layout, 1], res["runs"][layout, EP]
            # Step 0's loss is the forward loss of the initial weights.
            torch.testing.assert_close(torch.tensor(ep["losses"]), torch.tensor(dp["losses"]),
                                       **TOL)
            assert [s for s, _ in ep["val"]] == [s for s, _ in dp["val"]] == [1, 3]
            torch.testing.assert_close(torch.tensor([v for _, v in ep["val"]]),
                                       torch.tensor([v for _, v in dp["val"]]), **TOL)
            ep_state = _to_global(ep["state"], rank % EP, n_local)
            dp_state = _to_global(dp["state"], 0, 4)
            mine = global_expert_ids(ExpertParallel(rank % EP, EP, None, None), 4)
            held = {k for k in dp_state if _global_id(k) in (None, *mine)}
            assert set(ep_state) == held, layout
            for name in held:
                torch.testing.assert_close(ep_state[name], dp_state[name], **TOL,
                                           msg=lambda m, n=f"{layout} {name}": f"{n}: {m}")
        # Non-expert weights identical on every rank; expert replicas identical.
        states = [res["runs"][layout, EP]["state"] for res in results]
        for rank, state in enumerate(states):
            for name, value in state.items():
                peer = states[rank % EP] if "experts" in name else states[0]
                assert torch.equal(value, peer[name]), (layout, rank, name)
    if ("stacked", "fsdp") in results[0]["runs"]:
        _check_fsdp_x_ep(results, out_dir)
    for res in results:
        fwd = res["forward"]
        assert abs(fwd["ep_loss"] - fwd["ref_loss"]) < 1e-6 and fwd["logits_err"] < 1e-6
        for ra, rb in zip(fwd["ref_assigned"], fwd["ep_assigned"], strict=True):
            assert rb.shape == (4,) and int(rb.sum()) == 3 * 32 * 2  # local tokens * top_k
            assert torch.equal(ra, rb)
        ref_val, ep_val = res["eval"]
        assert ep_val == pytest.approx(ref_val, rel=1e-6)


def _check_fsdp_x_ep(results: list[dict], out_dir: Path) -> None:
    """FSDP x EP trains what data parallelism trains. Not bit for bit: FSDP reduce-scatters
    the gradients (another summation order than DP's all-reduce of one flat buffer) and
    the clip norm adds per-shard norms, so weights differ in the last bits after a step
    (measured: losses equal to all printed digits, norms within 1e-7)."""
    torch.testing.assert_close(_grad_norms(out_dir / "stacked-fsdp.jsonl"),
                               _grad_norms(out_dir / "stacked-ep1.jsonl"), **TOL)
    full = [res["runs"]["stacked", "fsdp"] for res in results]
    for rank, (res, run) in enumerate(zip(results, full, strict=True)):
        dp = res["runs"]["stacked", 1]
        # Step 0 is the forward of the same initial weights: the same loss exactly.
        assert run["losses"][0] == dp["losses"][0]
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(dp["losses"]),
                                   rtol=1e-6, atol=1e-6)
        assert [s for s, _ in run["val"]] == [s for s, _ in dp["val"]] == [1, 3]
        torch.testing.assert_close(torch.tensor([v for _, v in run["val"]]),
                                   torch.tensor([v for _, v in dp["val"]]), **TOL)
        assert run["state"].keys() == dp["state"].keys()
        for name, value in run["state"].items():
            torch.testing.assert_close(value, dp["state"][name], **TOL,
                                       msg=lambda m, n=name: f"fsdp x ep {n}: {m}")
            assert torch.equal(value, full[0]["state"][name]), (rank, name)


def _spawn(world: int, tmp_path: Path, cli_argv: list[str] | None = None) -> list[dict]:
    start_processes(_worker, (world, str(tmp_path / "store"), str(tmp_path), cli_argv), world)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def test_pure_ep_two_ranks_matches_data_parallel(tmp_path: Path) -> None:
    _check(_spawn(2, tmp_path), tmp_path)


@pytest.mark.slow
def test_dp_x_ep_four_ranks_matches_data_parallel(tmp_path: Path) -> None:
    # 4 ranks, ep 2: two EP groups {0,1} {2,3}, expert-DP groups {0,2} {1,3}. Also: an
    # --ep that divides n_experts but not the 4 ranks fails on every rank, one line, exit 2.
    argv = ["train", "--config", "tiny", "--steps", "1", "--batch-size", "8", "--no-progress",
            "--eval-batches", "0", "-O", "n_experts=6", "--ep", "3"]
    results = _spawn(4, tmp_path, argv)
    _check(results, tmp_path)
    for res in results:
        code, err = res["cli"]
        assert code == 2
        assert err.count("\n") == 1 and "ep=3 does not divide the 4 rank(s)" in err, err


def test_ep_init_is_the_slice_of_the_full_init() -> None:
    for layout in LAYOUTS:
        cfg = get_config("tiny", expert_layout=layout)
        torch.manual_seed(0)
        full = _to_global(GPTMoE(cfg).state_dict(), 0, 4)
        for r in range(EP):
            torch.manual_seed(0)
            model = GPTMoE(cfg, ExpertParallel(r, EP, None, None))
            local = _to_global(model.state_dict(), r, 4 // EP)
            assert len(local) < len(full)
            for name, value in local.items():
                assert torch.equal(value, full[name]), (layout, r, name)
            if layout == "stacked":
                assert model.blocks[1].ffn.experts.w1.shape[0] == 4 // EP


def test_parallel_helpers_without_a_process_group() -> None:
    ep = init_expert_parallel(1)
    assert (ep.rank, ep.size, ep.group, ep.expert_dp_group) == (0, 1, None, None)
    assert global_expert_ids(ep, 4) == [0, 1, 2, 3]
    assert global_expert_ids(ExpertParallel(1, 2, None, None), 8) == [4, 5, 6, 7]
    with pytest.raises(ConfigError, match="divides the number of ranks"):
        init_expert_parallel(2)
    with pytest.raises(ConfigError, match="divides the number of experts"):
        GPTMoE(get_config("tiny"), ExpertParallel(0, 3, None, None))


@pytest.mark.parametrize("argv, message", [
    (["--ep", "3"], "ep=3 does not divide n_experts=4"),
    (["--ep", "2"], "ep=2 does not divide the 1 rank(s)"),
    (["--ep", "0"], "ep must be a positive integer"),
])
def test_bad_ep_is_a_one_line_error(argv: list[str], message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", "--config", "tiny", "--steps", "1", "--batch-size", "2",
                 "--no-progress", "--eval-batches", "0", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
