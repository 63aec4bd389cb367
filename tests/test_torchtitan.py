"""moepec inside torchtitan's real Trainer (moepec.integrations.torchtitan).

deepseek_v3's debug model (narrowed: tests/titan_shims.py) trains under torchrun with one
process and with two (FSDP 2, then EP 2), saves K=1 checkpoints, is SIGKILLed, resumes at
the step of the newest checkpoint with every tensor bit-exact against the state it saved
(non-expert state from the newest checkpoint, each expert from its newest copy, both found
independently of moepec's restore from ``moepec inspect``), and finishes the run;
``moepec verify`` passes on the folder. Skipped when torchtitan 0.3 (``moepec[titan]``) is
not importable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

import pytest

pytest.importorskip("torchtitan.components.checkpointer", reason="torchtitan 0.3 is not importable")
pytest.importorskip("tokenizers", reason="the test tokenizer needs the tokenizers package")

import torch  # noqa: E402
from titan_assets import OVERRIDE, life_command  # noqa: E402

from moepec.recovery.offline import inspect_path  # noqa: E402

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
STEPS, KILL_AT, N_EXPERTS = 6, 5, 8
EXPERT = re.compile(r"^(model|optim)/layers\.(\d+)\..*moe\.routed_experts\.inner_experts\.")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A small tokenizer and data set (torchtitan's test assets are not in its wheel)."""
    from titan_assets import write_assets
    return write_assets(str(tmp_path_factory.mktemp("titan-assets")))


def _train(tmp: Path, assets, nproc: int, args: list[str], kill_at: int = 0):
    cmd, env = life_command(tmp, assets, nproc, STEPS, args, kill_at)
    return subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=240)


REGISTRY = ["--module", "moepec.integrations.torchtitan", "--config", "deepseek_v3_tiny",
            "--checkpoint.k_persist", "1", "--checkpoint.ram_dir", "None",
            "--checkpoint.no-dynamic_k"]


def test_registry_route_parses_moepec_flags(capsys):
    """``--module moepec.integrations.torchtitan --config NAME``: an upstream config, its
    checkpoint slot moepec's, whose fields parse as ``--checkpoint.*`` flags."""
    from torchtitan.config import ConfigManager

    from moepec.integrations.torchtitan import PecCheckpointManager

    config = ConfigManager().parse_args([
        "--module", "moepec.integrations.torchtitan", "--config", "deepseek_v3_debugmodel",
        "--checkpoint.enable", "--checkpoint.k_persist", "2", "--checkpoint.selection",
        "load_aware", "--checkpoint.keep_latest_k", "0"])
    ckpt = config.checkpoint
    assert type(ckpt) is PecCheckpointManager.Config
    assert (ckpt.k_persist, ckpt.selection, ckpt.interval) == (2, "load_aware", 10)
    assert ckpt.last_save_model_only is False  # the upstream config's own value is kept
    mc = ckpt.moepec_config("root")
    assert (mc.k_persist, mc.keep_last, mc.async_persist) == (2, 1_000_000, False)
    with pytest.raises(SystemExit):  # tyro's exit 2 for a bad flag, with moepec's message
        ConfigManager().parse_args([
            "--module", "moepec.integrations.torchtitan", "--config",
            "deepseek_v3_debugmodel", "--checkpoint.k_persist", "2",
            "--checkpoint.k_snapshot", "1"])
    err = " ".join(capsys.readouterr().err.split())
    assert "k_snapshot (1) must be" in err and "k_persist (2)" in err, err


def test_override_route_and_refusals():
    """``--override.imports '...use_pec={json}'`` on a stock config; what the manager does
    not support is refused with a message naming what to do."""
    from torch import nn
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    from moepec.errors import ConfigError
    from moepec.integrations.torchtitan import PecCheckpointManager

    config = deepseek_v3_debugmodel()
    apply_overrides(OverrideConfig(imports=[
        ("moepec.integrations.torchtitan.use_pec", {"k_persist": 3, "ram_dir": None})]), config)
    assert type(config.checkpoint) is PecCheckpointManager.Config
    assert (config.checkpoint.k_persist, config.checkpoint.ram_dir) == (3, None)
    with pytest.raises(ConfigError, match="unknown field.*k_persit"):
        apply_overrides(OverrideConfig(imports=[
            ("moepec.integrations.torchtitan.use_pec", {"k_persit": 3})]),
            deepseek_v3_debugmodel())
    args = dict(dataloader=None, model_parts=[nn.Linear(2, 2)], optimizers=None,
                lr_schedulers=None, states={}, sd_adapter=None)
    enabled = PecCheckpointManager.Config(enable=True)
    with pytest.raises(ConfigError, match="ft_manager.*fault_tolerance"):
        PecCheckpointManager(enabled, **args, ft_manager=object())
    with pytest.raises(ConfigError, match="pipeline"):
        PecCheckpointManager(enabled, **{**args, "model_parts": [nn.Linear(2, 2)] * 2})
    assert not PecCheckpointManager(PecCheckpointManager.Config(), **args).load()


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "moepec", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def _kill_resume_finish(tmp: Path, assets, first: tuple[int, list[str]],
                        second: tuple[int, list[str]]) -> None:
    (tmp / "dump").mkdir()
    life1 = _train(tmp, assets, first[0], first[1], kill_at=KILL_AT)
    crash = re.search(r"\((SIGSEGV|SIGBUS|SIGABRT)\)", life1.stderr)
    if crash:  # seen once in CI (rank 0, SIGSEGV, FSDP over gloo); here once in 44 80-step
        # lives pinned to one core, as glibc's heap-corruption abort (docs/testing.md).
        # Cause not found, so life 1 runs again from scratch, and the warning carries the
        # crash's stacks (faulthandler) for the next look
        warnings.warn(f"torchtitan life 1 crashed with {crash.group(1)}; ran it again. Its "
                      f"stderr (faulthandler stacks):\n{life1.stderr[-6000:]}", stacklevel=1)
        shutil.rmtree(tmp / "run")
        shutil.rmtree(tmp / "dump")
        (tmp / "dump").mkdir()
        life1 = _train(tmp, assets, first[0], first[1], kill_at=KILL_AT)
    assert life1.returncode != 0 and "SIGKILL" in life1.stderr, life1.stderr[-3000:]
    folder = tmp / "run" / "checkpoint"
    rows = [asdict(r) for r in inspect_path(str(folder))["checkpoints"]]  # `moepec inspect`'s
    ckpts = sorted((c for c in rows if c["committed"]), key=lambda c: c["step"])
    assert [c["step"] for c in ckpts] == list(range(1, KILL_AT))
    assert ckpts[0]["full"]
    for c in ckpts[1:]:  # K=1: one expert of N per MoE layer in every checkpoint after the first
        assert [len(e) for e in c["experts_saved"]] == [1, 1], c
    newest = {}  # (layer, expert) -> the step of its newest copy, from what inspect lists
    for c in ckpts:
        for layer, experts in enumerate(c["experts_saved"]):
            for e in experts:
                newest[layer, e] = c["step"]

    life2 = _train(tmp, assets, second[0], second[1])
    assert life2.returncode == 0, life2.stderr[-3000:]
    assert f"Training starts at step {KILL_AT}" in life2.stdout + life2.stderr
    dump = tmp / "dump"
    restored = torch.load(dump / "restored.pt")
    saved = {s: torch.load(dump / f"step-{s}.pt") for s in range(1, KILL_AT)}
    assert int(restored["train_state/step"]) == KILL_AT - 1
    # PLT from torchtitan's own token counters: the experts restored from older copies lost
    # the token assignments routed to them since (none would be counted without them)
    report = json.loads((dump / "sources.json").read_text())
    assert report["lost"] > 0 and 0 < report["plt"] < 1, report
    moe_layers = sorted({int(m.group(2)) for k in restored if (m := EXPERT.match(k))})
    assert len(moe_layers) == 2
    older = 0
    for key, value in restored.items():
        m = EXPERT.match(key)
        if m is None or value.dim() == 0:  # non-expert state (and Adam's step counter of a
            # stacked expert tensor, one for all its experts): the newest checkpoint's
            assert torch.equal(value, saved[KILL_AT - 1][key]), key
            continue
        layer = moe_layers.index(int(m.group(2)))
        for e in range(N_EXPERTS):  # each expert: its newest copy
            expect = saved[newest[layer, e]][key][e]
            assert torch.equal(value[e], expect), (key, e, newest[layer, e])
            older += not torch.equal(value[e], saved[KILL_AT - 1][key][e])
    assert older > 0  # some experts did come from older checkpoints, and differ
    for rank in range(second[0]):  # the data loader resumes where the newest checkpoint was
        pos = json.loads((dump / f"restored-loader-{rank}.json").read_text())
        assert pos == json.loads((dump / f"step-{KILL_AT - 1}-loader-{rank}.json").read_text())
    assert int(torch.load(dump / f"step-{STEPS}.pt")["train_state/step"]) == STEPS
    verify = _cli("verify", str(folder))
    assert verify.returncode == 0 and verify.stdout.startswith("OK"), verify.stdout


@pytest.mark.slow
@pytest.mark.timeout(1200)  # two or three torchrun lives of up to 240 s each on a busy machine
def test_one_process_killed_resumes_bit_exact(tmp_path, assets):
    _kill_resume_finish(tmp_path, assets, (1, OVERRIDE), (1, REGISTRY))


@pytest.mark.slow
@pytest.mark.timeout(1200)  # two or three torchrun lives of up to 240 s each on a busy machine
def test_fsdp_then_ep2_killed_resumes_bit_exact(tmp_path, assets):
    """Life 1: FSDP over 2 ranks; life 2: EP 2 (the experts' layout changes on resume)."""
    _kill_resume_finish(tmp_path, assets, (2, OVERRIDE),
                        (2, [*REGISTRY, "--parallelism.expert_parallel_degree", "2"]))
