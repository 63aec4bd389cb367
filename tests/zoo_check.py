"""Train any model a few steps with PEC at K=1 and check restore and export exactly.

Shared by the zoo tests (transformers models) and the toy models of the discovery tests
(torchtitan names, LongcatFlash-like ragged experts). Independent of moepec's internals
except the committed manifests, read to know at which step each expert was saved.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from safetensors.torch import load_file
from torch import nn

from moepec import CheckpointConfig, CheckpointManager, ExpertSpec
from moepec.keys import parse_key
from moepec.recovery.offline import export_view


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Deep copy of parameters, buffers and optimizer state, keyed like the checkpoint."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model/{n}": v.detach().clone() for n, v in model.state_dict().items()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if torch.is_tensor(v):
                out[f"optim/{names[id(p)]}/{k}"] = v.clone()
    return out


def saved_step(manifests, layer: int, expert: int, part: str, base: int) -> int:
    """Step of the newest committed checkpoint (<= base) holding a copy of an expert unit."""
    steps = [m.step for m in manifests if m.step <= base and any(
        parse_key(k).is_expert and parse_key(k).layer == layer
        and parse_key(k).expert == expert and parse_key(k).part == part for k in m.keys)]
    assert steps, f"expert {expert} of layer {layer} ({part}) was never saved"
    return max(steps)


def train_restore_export(tmp_path, build: Callable[[], nn.Module],
                         loss_fn: Callable[[nn.Module, int], torch.Tensor], *,
                         steps: int = 6, interval: int = 2, spec: ExpertSpec | None = None
                         ) -> dict:
    """Train ``steps`` steps checkpointing every ``interval`` at K=1, restore into a fresh
    model and check every tensor bit for bit: non-expert state as at the newest checkpoint,
    each expert as at the step it was last saved (stale on purpose). Then export the view
    to safetensors and load it with ``load_state_dict(strict=True)``. Returns facts for
    the caller's own asserts (the discovery map, how many expert units were stale)."""
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = CheckpointConfig(path=str(tmp_path / "ckpt"), interval=interval, k_persist=1,
                           keep_last=steps, async_snapshot=False, async_persist=False)
    manager = CheckpointManager(model, opt, cfg, expert_spec=spec)
    history = {}
    for step in range(steps):
        loss = loss_fn(model, step)
        opt.zero_grad()
        loss.backward()
        manager.wait_for_snapshot()
        opt.step()
        if manager.step(step):
            history[step] = snapshot(model, opt)
    manager.close()
    final = snapshot(model, opt)

    torch.manual_seed(1)  # a different initialisation: restore must overwrite all of it
    model2 = build()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    restorer = CheckpointManager(model2, opt2, cfg, expert_spec=spec)
    report = restorer.restore()
    base = max(history)
    assert report is not None and report.step == base
    manifests = [restorer._storage.read_manifest(n) for n in restorer._storage.committed()]
    emap = restorer._emap
    restored = snapshot(model2, opt2)
    assert restored.keys() == final.keys()
    stale = 0
    for key, value in restored.items():
        pname = key.split("/", 1)[1].rsplit("/", 1)[0] if key.startswith("optim/") \
            else key.split("/", 1)[1]
        if pname not in emap.owner or key.endswith("/step"):
            assert torch.equal(value, history[base][key]), key
            continue
        layer_i, owner_e = emap.owner[pname]
        part = "optim" if key.startswith("optim/") else "model"
        for e in range(value.shape[0]) if owner_e is None else [owner_e]:
            src = saved_step(manifests, layer_i, e, part, base)
            got = value[e] if owner_e is None else value
            want = history[src][key][e] if owner_e is None else history[src][key]
            assert torch.equal(got, want), (key, e, src)
            if src < base and not torch.equal(got, final[key][e] if owner_e is None
                                              else final[key]):
                stale += 1
    restorer.close()

    out = tmp_path / "export.safetensors"
    export_view(str(tmp_path / "ckpt"), str(out), "safetensors")
    weights = load_file(str(out))  # the model's own names
    torch.manual_seed(2)
    model3 = build()
    model3.load_state_dict(weights, strict=True)
    for n, v in model3.state_dict().items():
        assert torch.equal(v, restored[f"model/{n}"]), n
    return {"emap": emap, "stale": stale, "report": report, "model": model2}
