"""PecCheckpointManager (moepec.integrations.torchtitan) with torchtitan's own objects, in
process (no launcher): what torchtitan's checkpoint manager does and users rely on.

- several optimizers per model part (torchtitan builds one per ``optimizer_name``): each
  one's per-expert state goes with its expert, saved K of N and restored from the copy
  the RestoreReport names;
- ``--checkpoint.load_step``: the newest view at or before that step (that step's own
  when it was saved), FileNotFoundError when there is none, and training goes on from it;
- a dense model (torchtitan's llama3 debug model) gets full checkpoints, one warning;
- ``initial_load_path`` from a stock DCP folder (model only, and the training state), and
  ``last_save_model_only``: both as torchtitan's own manager does them;
- a bare tensor in ``states``, and an optimizers object that is only stateful, are saved
  and restored bit for bit.

The model is deepseek_v3's debug model narrowed (tests/titan_models.py: 2 MoE layers of 8
experts); gradients are random (the forward pass is not what is tested), so a step is
cheap. Skipped when torchtitan 0.3 (``moepec[titan]``) is not importable.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest

pytest.importorskip("torchtitan.components.checkpointer", reason="torchtitan 0.3 is not importable")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from moepec import StructureMismatchError  # noqa: E402
from moepec.integrations.torchtitan import PecCheckpointManager  # noqa: E402
from moepec.recovery.offline import inspect_path  # noqa: E402

N_EXPERTS = 8
EXPERT = re.compile(r"^layers\.(\d+)\.moe\.routed_experts\.inner_experts\.")


class _Stateless:
    """The LR schedulers slot: a stateful object with nothing in it."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        assert saved == {}


def _moe_model(seed: int) -> nn.Module:
    from titan_models import tiny_deepseek_v3

    torch.manual_seed(seed)
    model = tiny_deepseek_v3().build()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def _optimizers(model: nn.Module, two: bool = True) -> Any:
    """torchtitan's OptimizersContainer: Adam over the experts' w1 and w3, AdamW over the
    rest (the experts' w2 included), so every expert has state in both; or AdamW alone."""
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    groups = [ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                               optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.1})]
    if two:
        groups.insert(0, ParamGroupConfig(pattern=r"inner_experts\.w[13]_",
                                          optimizer_name="Adam",
                                          optimizer_kwargs={"lr": 1e-2, "betas": (0.8, 0.9)}))
    config = OptimizersContainer.Config(implementation="for-loop", param_groups=groups)
    return OptimizersContainer(config, model_parts=[model])


def _manager(tmp_path, model: nn.Module, optimizers: Any, states: dict | None = None,
             **fields: Any) -> PecCheckpointManager:
    config = PecCheckpointManager.Config(**{
        "enable": True, "folder": "ckpt", "async_mode": "disabled", "keep_latest_k": 0,
        "interval": 1, "k_persist": 1, "ram_dir": None, "dynamic_k": False, **fields})
    return PecCheckpointManager(config, dataloader=None, model_parts=[model],
                                optimizers=optimizers, lr_schedulers=_Stateless(),
                                states=states or {}, sd_adapter=None, base_folder=str(tmp_path))


def _state(model: nn.Module, optimizers: Any) -> dict[str, torch.Tensor]:
    """Weights and every optimizer's state, deep-copied (``optim<i>/<param>/<state>``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model/{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, opt in enumerate(getattr(optimizers, "optimizers", [])):
        for p, st in opt.state.items():
            for k, v in st.items():
                out[f"optim{i}/{names[id(p)]}/{k}"] = v.detach().clone()
    return out


def _train(ckpt: PecCheckpointManager, model: nn.Module, optimizers: Any, steps: range,
           history: dict[int, dict[str, torch.Tensor]], seed: int = 1) -> None:
    """torchtitan's order: gradients, maybe_wait_for_staging, optimizer step, save."""
    gen = torch.Generator().manual_seed(seed)
    for step in steps:
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        ckpt.maybe_wait_for_staging()
        optimizers.step()
        if ckpt.save(step):
            history[step] = _state(model, optimizers)


def _check_view(restored: dict[str, torch.Tensor], history: dict[int, dict[str, torch.Tensor]],
                report: Any) -> int:
    """Every expert tensor equals its value at the step the report names for the expert,
    everything else the base step's; returns how many expert slices came from older steps
    and differ from the base's."""
    base = history[report.step]
    assert restored.keys() == base.keys()
    moe_layers = sorted({int(m.group(1)) for k in restored
                         if (m := EXPERT.match(k.split("/", 1)[1]))})
    assert len(moe_layers) == 2
    older = 0
    for key, value in restored.items():
        m = EXPERT.match(key.split("/", 1)[1])
        if m is None or value.dim() == 0:  # non-expert state, and Adam's step counters
            assert torch.equal(value, base[key]), key
            continue
        layer = moe_layers.index(int(m.group(1)))
        for e in range(N_EXPERTS):
            src = report.sources[f"{layer}/{e}"]["step"]
            assert src <= report.step
            assert torch.equal(value[e], history[src][key][e]), (key, e, src)
            older += not torch.equal(value[e], base[key][e])
    return older


def _names(tmp_path, step: int) -> list[str]:
    """The committed checkpoints of ``step`` in the folder (``moepec inspect``'s rows)."""
    return sorted(c.name for c in inspect_path(str(tmp_path / "ckpt"))["checkpoints"]
                  if c.step == step and c.committed)


def test_two_optimizers_keep_each_experts_state_with_the_expert(tmp_path):
    """torchtitan's OptimizersContainer of Adam + AdamW over one model part: K=1 of 8
    checkpoints at every step; a fresh model and optimizers restore each expert's
    weights and its moments in both optimizers from the copy the report names."""
    model = _moe_model(0)
    optimizers = _optimizers(model)
    assert len(optimizers.optimizers) == 2
    ckpt = _manager(tmp_path, model, optimizers)
    history: dict[int, dict[str, torch.Tensor]] = {}
    _train(ckpt, model, optimizers, range(1, 7), history)
    ckpt.close()

    model = _moe_model(7)
    optimizers = _optimizers(model)
    ckpt = _manager(tmp_path, model, optimizers)
    assert ckpt.load()
    ckpt.close()
    restored = _state(model, optimizers)
    assert any(k.startswith("optim0/") and "inner_experts.w1_EFD/exp_avg" in k for k in restored)
    assert any(k.startswith("optim1/") and "inner_experts.w2_EDF/exp_avg" in k for k in restored)
    assert ckpt.report.step == 6
    assert _check_view(restored, history, ckpt.report) > 0
    assert optimizers.optimizers[0].param_groups[0]["betas"] == (0.8, 0.9)


def test_load_step_loads_the_view_at_or_before_it(tmp_path, caplog):
    """Checkpoints at steps 2, 4, 6: ``load_step`` 4 restores step 4's view (no expert from
    step 6), 5 restores it too (with a warning), 1 and a missing folder raise torchtitan's
    FileNotFoundError; training on from step 4 writes a new step 6, which the next plain
    load restores."""
    model = _moe_model(0)
    optimizers = _optimizers(model, two=False)
    ckpt = _manager(tmp_path, model, optimizers, interval=2)
    history: dict[int, dict[str, torch.Tensor]] = {}
    _train(ckpt, model, optimizers, range(1, 8), history)
    ckpt.close()
    assert sorted(history) == [2, 4, 6]
    first_six = _names(tmp_path, 6)

    for asked in (4, 5):
        model = _moe_model(7)
        optimizers = _optimizers(model, two=False)
        ckpt = _manager(tmp_path, model, optimizers, interval=2)
        with caplog.at_level(logging.WARNING, "moepec.integrations.torchtitan"):
            caplog.clear()
            assert ckpt.load(step=asked)
        assert ckpt.report.step == 4
        assert ("no whole view at that step" in caplog.text) == (asked == 5)
        assert _check_view(_state(model, optimizers), history, ckpt.report) > 0
        if asked == 5:  # go on from step 4: steps 5 and 6 again, another path
            _train(ckpt, model, optimizers, range(5, 7), history, seed=3)
        ckpt.close()

    model = _moe_model(7)
    optimizers = _optimizers(model, two=False)
    ckpt = _manager(tmp_path, model, optimizers, interval=2)
    assert ckpt.load()  # the newest: the new step 6, whose view continues step 4's
    assert ckpt.report.step == 6
    _check_view(_state(model, optimizers), history, ckpt.report)
    newest = ckpt.report.checkpoint
    with pytest.raises(FileNotFoundError, match="--checkpoint.load_step=1"):
        ckpt.load(step=1)
    ckpt.close()
    # the abandoned step 6 is off the new lineage: retention removed it at the next commit
    assert _names(tmp_path, 6) == [newest] != first_six
    missing = _manager(tmp_path / "nothing", nn.Linear(2, 2), None)
    with pytest.raises(FileNotFoundError, match="--checkpoint.load_step=5"):
        missing.load(step=5)
    missing.close()


def test_load_step_of_a_view_retention_broke_says_so(tmp_path):
    """keep_latest_k 2 keeps the views of the two newest checkpoints whole; an older view
    that lost copies to retention is a FileNotFoundError naming keep_latest_k."""
    model = _moe_model(0)
    optimizers = _optimizers(model, two=False)
    ckpt = _manager(tmp_path, model, optimizers, keep_latest_k=2, k_persist=2)
    _train(ckpt, model, optimizers, range(1, 8), {})
    ckpt.close()
    rows = inspect_path(str(tmp_path / "ckpt"))["checkpoints"]
    steps = sorted(c.step for c in rows)
    assert steps[0] > 1 and steps[-2:] == [6, 7]  # retention deleted the oldest ones
    # What is left is exactly what the views of the two newest need (each expert's newest
    # copy at or before them, from what each kept checkpoint says it saved): both whole.
    assert set(steps) == _needed(rows, 6) | _needed(rows, 7)
    model = _moe_model(7)
    ckpt = _manager(tmp_path, model, _optimizers(model, two=False))
    with pytest.raises(FileNotFoundError, match="no longer whole.*keep_latest_k"):
        ckpt.load(step=steps[0])
    assert ckpt.load(step=6) and ckpt.report.step == 6
    ckpt.close()


def _needed(rows: list, step: int) -> set[int]:
    """The steps holding the newest copy, at or before ``step``, of every expert (and the
    non-expert state of ``step``), from the kept checkpoints' own lists; fails when an
    expert has no copy left (the view is not whole)."""
    kept = sorted((c for c in rows if c.step <= step), key=lambda c: c.step, reverse=True)
    need = {step}
    for layer in range(2):
        for e in range(N_EXPERTS):
            src = next((c.step for c in kept if c.full or e in c.experts_saved[layer]), None)
            assert src is not None, (step, layer, e)
            need.add(src)
    return need


def test_dense_model_gets_full_checkpoints_and_one_warning_line(tmp_path, caplog):
    """torchtitan's llama3 debug model (no MoE layer) under the moepec manager: full
    checkpoints, one warning line saying so (what was looked for, how to name experts);
    restored bit for bit."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = llama3_debugmodel().model_spec.model.build()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
        return model

    model = build(0)
    optimizers = _optimizers(model, two=False)
    with caplog.at_level(logging.DEBUG, "moepec"):
        ckpt = _manager(tmp_path, model, optimizers)
    [said] = [r.getMessage() for r in caplog.records if r.name.startswith("moepec")
              and r.levelno >= logging.WARNING]
    assert said.startswith("moepec: no experts found in the model (looked for torchtitan "
                           "MoE layers") and "\n" not in said
    assert f"every checkpoint in {tmp_path / 'ckpt'} is a full one" in said
    assert "--checkpoint.expert_stacked REGEX" in said, said
    history: dict[int, dict[str, torch.Tensor]] = {}
    _train(ckpt, model, optimizers, range(1, 3), history)
    ckpt.close()
    rows = inspect_path(str(tmp_path / "ckpt"))["checkpoints"]  # `moepec inspect`: "full"
    assert [(c.step, c.full, c.committed) for c in rows] == [(1, True, True), (2, True, True)]

    model = build(7)
    optimizers = _optimizers(model, two=False)
    ckpt = _manager(tmp_path, model, optimizers)
    assert ckpt.load() and ckpt.report.step == 2
    ckpt.close()
    restored = _state(model, optimizers)
    assert restored.keys() == history[2].keys()
    for key, value in restored.items():
        assert torch.equal(value, history[2][key]), key


class _StatefulOptimizers:
    """What torchtitan's own checkpoint tests pass as ``optimizers``: stateful, not an
    OptimizersContainer of torch optimizers."""

    def __init__(self) -> None:
        self.param = torch.tensor([1.0])

    def state_dict(self) -> dict[str, Any]:
        return {"param": self.param}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.param = saved["param"]


def test_plain_tensors_in_states_and_stateful_optimizers_restore_bit_for_bit(tmp_path):
    """A bare tensor in ``states`` (torchtitan's own tests hold one) is saved with the
    non-expert state and restored into the same tensor; an optimizers object that is only
    stateful is saved whole."""
    model = nn.Linear(2, 2)
    trainer = torch.tensor([1.2347])
    scale = torch.randn(3, 4, dtype=torch.float64)
    bits = torch.tensor([1, 0, 1], dtype=torch.bool)
    optimizers = _StatefulOptimizers()
    states = {"trainer": trainer, "scale": scale, "bits": bits}
    want = {k: v.clone() for k, v in states.items()}
    weight = model.weight.detach().clone()
    ckpt = _manager(tmp_path, model, optimizers, states)
    assert ckpt.save(curr_step=1)
    with torch.no_grad():
        model.weight.zero_()
        for t in states.values():
            t.zero_()
    optimizers.param = torch.tensor([42.0])
    assert ckpt.load(step=1)
    ckpt.close()
    assert torch.equal(model.weight, weight) and torch.equal(optimizers.param, torch.tensor([1.0]))
    for k, v in states.items():  # the very tensors torchtitan holds, bit for bit
        assert v.dtype == want[k].dtype and torch.equal(v, want[k]), k
    assert trainer.data_ptr() == states["trainer"].data_ptr()
    ckpt = _manager(tmp_path, model, optimizers, {**states, "scale": torch.zeros(2)})
    with pytest.raises(StructureMismatchError, match=r"float64 \(3, 4\) where the states "
                       r"hold torch.float32 \(2,\)"):
        ckpt.load()
    ckpt.close()


def _stock(folder, model: nn.Module, optimizers: Any, **fields: Any):
    """torchtitan's own DCP checkpoint manager over the same objects."""
    from torchtitan.components.checkpointer import CheckpointManager

    config = CheckpointManager.Config(**{"enable": True, "folder": "stock", "interval": 1,
                                         "keep_latest_k": 0, **fields})
    return CheckpointManager(config, dataloader=None, model_parts=[model],
                             optimizers=optimizers, lr_schedulers=_Stateless(), states={},
                             sd_adapter=None, base_folder=str(folder))


def test_initial_load_from_a_stock_dcp_checkpoint(tmp_path):
    """A folder without a moepec checkpoint starts from ``initial_load_path``, a stock DCP
    checkpoint of another run: the model alone (``initial_load_model_only``, the default)
    or the training state, bit for bit as saved; the next save is a full moepec one, and
    a restart restores it, not the initial checkpoint."""
    model = _moe_model(0)
    optimizers = _optimizers(model)
    history: dict[int, dict[str, torch.Tensor]] = {}
    stock = _stock(tmp_path, model, optimizers, last_save_model_only=False)
    _train(stock, model, optimizers, range(1, 3), history)
    stock.close()
    saved = history[2]
    for model_only in (True, False):
        run = tmp_path / f"model_only_{model_only}"
        fresh = _moe_model(7)
        opts = _optimizers(fresh)
        ckpt = _manager(run, fresh, opts, initial_load_path=str(tmp_path / "stock" / "step-2"),
                        initial_load_model_only=model_only)
        assert ckpt.load() and ckpt.report is None
        got = _state(fresh, opts)
        want = {k: v for k, v in saved.items() if not model_only or k.startswith("model/")}
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), model_only
        _train(ckpt, fresh, opts, range(3, 4), history)
        ckpt.close()
        [row] = inspect_path(str(run / "ckpt"))["checkpoints"]
        assert (row.step, row.full, row.committed) == (3, True, True)
        other = _moe_model(8)
        again = _manager(run, other, _optimizers(other),
                         initial_load_path=str(tmp_path / "stock" / "step-2"))
        assert again.load() and again.report.step == 3
        again.close()


def test_last_save_is_the_model_alone_as_stocks(tmp_path):
    """``last_save_model_only`` (torchtitan's default): the last save is torchtitan's own
    model-only DCP folder ``step-<N>``, the same keys and values as stock's for the same
    state, in ``export_dtype``; moepec's checkpoints hold the earlier saves."""
    import torch.distributed.checkpoint as dcp

    model = _moe_model(0)
    optimizers = _optimizers(model, two=False)
    ckpt = _manager(tmp_path, model, optimizers, interval=2, export_dtype="bfloat16")
    _train(ckpt, model, optimizers, range(1, 4), {})
    assert ckpt.save(curr_step=4, last_step=True)
    ckpt.close()
    assert [c.step for c in inspect_path(str(tmp_path / "ckpt"))["checkpoints"]] == [2]
    stock = _stock(tmp_path, model, optimizers, export_dtype="bfloat16")
    assert stock.save(curr_step=4, last_step=True)
    stock.close()
    ours, theirs = (dcp.FileSystemReader(str(tmp_path / d / "step-4")).read_metadata()
                    for d in ("ckpt", "stock"))
    assert set(ours.state_dict_metadata) == set(theirs.state_dict_metadata) \
        == set(model.state_dict())
    back = {k: torch.empty_like(v, dtype=torch.bfloat16) for k, v in model.state_dict().items()}
    dcp.load(back, checkpoint_id=str(tmp_path / "ckpt" / "step-4"))
    assert all(torch.equal(back[k], v.to(torch.bfloat16)) for k, v in model.state_dict().items())


def test_the_last_steps_save_holds_every_expert_and_resumes_exactly(tmp_path):
    """torchtitan's last step (``last_step=True``) with ``last_save_model_only`` off: a
    complete moepec checkpoint (every expert, K = N once, where the saves before it hold
    K = 1), so the next load reads nothing older: PLT 0, every expert and all the rest as
    at that step, bit for bit."""
    model = _moe_model(0)
    optimizers = _optimizers(model, two=False)
    ckpt = _manager(tmp_path, model, optimizers, interval=2, last_save_model_only=False)
    history: dict[int, dict[str, torch.Tensor]] = {}
    _train(ckpt, model, optimizers, range(1, 5), history)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    ckpt.maybe_wait_for_staging()
    optimizers.step()
    assert ckpt.save(curr_step=5, last_step=True)
    history[5] = _state(model, optimizers)
    ckpt.close()
    rows = {c.step: c for c in inspect_path(str(tmp_path / "ckpt"))["checkpoints"]}
    assert sorted(rows) == [2, 4, 5] and not rows[4].full and rows[5].full
    assert [len(layer) for layer in rows[4].experts_saved] == [1, 1]

    model = _moe_model(7)
    optimizers = _optimizers(model, two=False)
    again = _manager(tmp_path, model, optimizers, interval=2, last_save_model_only=False)
    assert again.load()
    report = again.report
    assert report.step == 5 and report.plt == 0 and report.lost_total == 0
    assert {s["step"] for s in report.sources.values()} == {5}
    assert len(report.sources) == 2 * N_EXPERTS
    assert _check_view(_state(model, optimizers), history, report) == 0
    again.close()
