"""pytest plugin: Megatron-Core 0.16.1's own ``dist_checkpointing`` unit tests on CPU/gloo
under torchrun, with the stock ``torch_dist`` save backend or moepec's ``("moepec", 1)``.

Loaded with ``-p mcore_cpu_plugin`` (this folder on PYTHONPATH, pytest run from the root
of an extracted Megatron-LM tree); driven by ``driver.py``. Never collected by the
project's own pytest (testpaths = tests; no test_*.py or conftest.py here).

Environment:
  MCORE_BACKEND        torch_dist (default) | moepec
  MCORE_RESULTS_DIR    where each rank appends its records (rank<R>.jsonl)
  MCORE_DESELECT       a file of node ids not to run (finished in an earlier attempt)
  MCORE_PG_TIMEOUT_S   gloo collective timeout (default 150)
  MCORE_GROUPED_GEMM_STANDIN  1 (default) | 0: the grouped_gemm stand-in (see below)

What it changes, all outside Megatron-LM's files:
  * ``Utils.initialize_distributed`` initializes gloo (env://, torchrun's variables) instead
    of NCCL on a CUDA device; ``Utils.set_world_size`` counts ranks, not GPUs.
  * ``Utils.initialize_model_parallel`` fits TP x CP x PP (and EP x ETP x PP) into the world
    size by halving the largest factor (the tests assume 8 ranks); a test that relied on
    the 8-rank layout then fails with stock too and is left out of the comparison.
  * moepec's CPU shims (tests/megatron_shims.py of the moepec repo), no-op
    ``torch.cuda.set_device``; ``is_te_min_version`` answers False without Transformer
    Engine (Megatron's own raises TypeError); a stand-in
    ``transformer_engine.pytorch.fp8`` only while a test module is imported
    (models/test_moe_experts.py imports it at the top; fp8 then reports unsupported).
  * without the CUDA package ``grouped_gemm``, the moepec repo's plain-torch stand-in
    (tests/grouped_gemm_standin.py) is installed before megatron is imported, so the
    legacy ``GroupedMLP`` cases (``grouped``) build and run;
    MCORE_GROUPED_GEMM_STANDIN=0 leaves it out.
  * tests that need CUDA in their code (``.cuda()``, ``device='cuda'``,
    ``torch.cuda.memory_*``, a ``cuda`` parameter) are skipped as ``cuda-only``, and so
    is ``persistent=True`` (PersistentAsyncCaller's spawned worker, which the shims do not
    reach, calls ``torch.cuda.set_device(rank % torch.cuda.device_count())``).
  * MCORE_BACKEND=moepec: ``import moepec.integrations.megatron`` and its switch
    ``use_for_torch_dist()``: every request for
    the ``("torch_dist", 1)`` SAVE_SHARDED strategy through ``get_default_strategy``
    (the tests' default save, ``get_default_save_sharded_strategy()``, and their explicit
    ``get_default_strategy(SAVE_SHARDED, 'torch_dist', 1)``) gets ``("moepec", 1)``.
    Tests that build ``TorchDistSaveShardedStrategy(...)`` themselves still save with
    torch_dist; each record counts the saves of each backend so the driver can tell.
"""

from __future__ import annotations

import datetime
import importlib.util
import inspect
import json
import os
import re
import sys
import time
import types
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BACKEND = os.environ.get("MCORE_BACKEND", "torch_dist")
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RESULTS = os.environ.get("MCORE_RESULTS_DIR")
PG_TIMEOUT = float(os.environ.get("MCORE_PG_TIMEOUT_S", "150"))

sys.path.insert(0, str(REPO / "tests"))
# Megatron-Core's legacy GroupedMLP needs the CUDA package grouped_gemm, read once by
# megatron.core.transformer.moe.grouped_gemm_util at import. Without the real package,
# put the moepec repo's plain-torch stand-in (tests/grouped_gemm_standin.py) into
# sys.modules here: pytest imports this plugin (-p) in each rank's process before any
# conftest or test module, so before anything imports megatron (install() refuses
# otherwise). MCORE_GROUPED_GEMM_STANDIN=0 leaves it out (GroupedMLP cases then fail).
GROUPED_GEMM = "real"
if importlib.util.find_spec("grouped_gemm") is None:
    GROUPED_GEMM = "absent"
    if os.environ.get("MCORE_GROUPED_GEMM_STANDIN", "1") != "0":
        import grouped_gemm_standin  # noqa: E402

        grouped_gemm_standin.install()
        GROUPED_GEMM = "stand-in"
import megatron_shims  # noqa: E402  (the moepec repo's CPU shims)

megatron_shims.install()
torch.cuda.set_device = lambda *args, **kwargs: None

import megatron.core.utils as mcore_utils  # noqa: E402

_orig_is_te_min_version = mcore_utils.is_te_min_version
_HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def _is_te_min_version(version, check_equality=True):
    if not _HAVE_TE:
        return False
    return _orig_is_te_min_version(version, check_equality)


mcore_utils.is_te_min_version = _is_te_min_version

# model_parallel_cuda_manual_seed seeds CUDA RNG states (torch.cuda.get_rng_state): the
# tests call torch.manual_seed(seed) just before it and build with use_cpu_initialization.
import megatron.core.tensor_parallel as _tp  # noqa: E402
import megatron.core.tensor_parallel.random as _tp_random  # noqa: E402


def _cpu_manual_seed(seed, *args, **kwargs):
    torch.manual_seed(seed)


_tp_random.model_parallel_cuda_manual_seed = _cpu_manual_seed
_tp.model_parallel_cuda_manual_seed = _cpu_manual_seed

# tests/unit_tests/conftest.py imports Megatron's dataset downloader (network); stand-in.
_dl = types.ModuleType("tests.test_utils.python_scripts.download_unit_tests_dataset")


def _no_download(*args, **kwargs):
    raise ImportError("no test data download in the CPU harness")


_dl.download_and_extract_asset = _no_download
sys.modules[_dl.__name__] = _dl

from megatron.core.dist_checkpointing.strategies.torch import (  # noqa: E402
    TorchDistSaveShardedStrategy,
)

SAVES = {"torch_dist": 0, "moepec": 0}


def _count(cls, name):
    orig = cls.async_save

    def async_save(self, *args, **kwargs):
        SAVES[name] += 1
        return orig(self, *args, **kwargs)

    cls.async_save = async_save


_count(TorchDistSaveShardedStrategy, "torch_dist")

if BACKEND == "moepec":
    import moepec.integrations.megatron as moepec_megatron  # noqa: E402  (registers it)

    _count(moepec_megatron.MoepecSaveStrategy, "moepec")
    # The public switch a Megatron-LM user turns on (docs/megatron.md): every default
    # ("torch_dist", 1) SAVE_SHARDED lookup answers ("moepec", 1).
    moepec_megatron.use_for_torch_dist()
elif BACKEND != "torch_dist":
    raise SystemExit(f"MCORE_BACKEND must be torch_dist or moepec, not {BACKEND!r}")


# --- Utils: gloo, world-size fitting -------------------------------------------------------

def _fit(world, *factors):
    """Halve the largest factor until the product divides ``world``."""
    f = list(factors)
    while world % max(1, _prod(f)) and max(f) > 1:
        i = f.index(max(f))
        f[i] //= 2
    return f


def _prod(xs):
    out = 1
    for x in xs:
        out *= x
    return out


def _patch_utils():
    import megatron.core.parallel_state as ps
    from tests.unit_tests.test_utilities import Utils

    Utils.world_size, Utils.rank = WORLD, int(os.environ.get("LOCAL_RANK", "0"))

    def initialize_distributed():
        for var in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
            os.environ.pop(var, None)
        if not torch.distributed.is_initialized() and Utils.rank >= 0:
            torch.distributed.init_process_group(
                "gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT))
            torch.distributed.barrier()
        Utils.inited = True

    def set_world_size(world_size=None, rank=None):
        Utils.world_size = WORLD if world_size is None else world_size
        if (torch.distributed.is_initialized()
                and Utils.world_size != torch.distributed.get_world_size()):
            torch.distributed.destroy_process_group()
        if rank is None:
            Utils.rank = int(os.environ["LOCAL_RANK"])
            if Utils.rank >= Utils.world_size:
                Utils.rank = -1
        else:
            Utils.rank = rank

    def initialize_model_parallel(tensor_model_parallel_size=1,
                                  pipeline_model_parallel_size=1,
                                  virtual_pipeline_model_parallel_size=None, **kwargs):
        for var in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
            os.environ.pop(var, None)
        ps.destroy_model_parallel()
        initialize_distributed()
        world = torch.distributed.get_world_size()
        cp = kwargs.get("context_parallel_size", 1)
        tp, cp, pp = _fit(world, tensor_model_parallel_size, cp,
                          pipeline_model_parallel_size)
        if "context_parallel_size" in kwargs:
            kwargs["context_parallel_size"] = cp
        ep = kwargs.get("expert_model_parallel_size", 1)
        etp = kwargs.get("expert_tensor_parallel_size") or tp
        if kwargs.get("expert_tensor_parallel_size") is not None and etp > tp:
            etp = tp  # keep ETP <= TP as it was relative to the 8-rank layout
        ep, etp = _fit(world // pp, ep, etp)
        if "expert_model_parallel_size" in kwargs:
            kwargs["expert_model_parallel_size"] = ep
        if kwargs.get("expert_tensor_parallel_size") is not None:
            kwargs["expert_tensor_parallel_size"] = etp
        if (virtual_pipeline_model_parallel_size is not None and pp == 1):
            virtual_pipeline_model_parallel_size = None
        ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size, **kwargs)
        Utils.inited = True

    Utils.initialize_distributed = staticmethod(initialize_distributed)
    Utils.set_world_size = staticmethod(set_world_size)
    Utils.initialize_model_parallel = staticmethod(initialize_model_parallel)


# --- pytest hooks ----------------------------------------------------------------------------

_CUDA_SRC = re.compile(r"\.cuda\(\)|device=['\"]cuda['\"]|torch\.cuda\.(memory|max_memory)"
                       r"|fp8_autocast|check_fp8_support\(\)")


def pytest_configure(config):
    if RESULTS:
        base = Path(RESULTS) / "tmp" / f"rank{RANK}"
        base.parent.mkdir(parents=True, exist_ok=True)
        config.option.basetemp = str(base)
    _patch_utils()


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A stand-in ``transformer_engine.pytorch.fp8`` while a test module is imported
    (Megatron itself imported first, so it still sees no Transformer Engine)."""
    if not isinstance(collector, pytest.Module):
        return (yield)
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.transformer.moe.experts  # noqa: F401

    added = []
    if "transformer_engine" not in sys.modules:
        te = types.ModuleType("transformer_engine")
        te_pt = types.ModuleType("transformer_engine.pytorch")
        fp8 = types.ModuleType("transformer_engine.pytorch.fp8")
        fp8.check_fp8_support = lambda: (False, "no Transformer Engine (CPU harness)")

        def fp8_autocast(*args, **kwargs):
            raise RuntimeError("fp8_autocast: no Transformer Engine (CPU harness)")

        fp8.fp8_autocast = fp8_autocast
        te.pytorch, te_pt.fp8 = te_pt, fp8
        for mod in (te, te_pt, fp8):
            sys.modules[mod.__name__] = mod
            added.append(mod.__name__)
    try:
        return (yield)
    finally:
        for name in added:
            sys.modules.pop(name, None)


def pytest_collection_modifyitems(config, items):
    done = set()
    if os.environ.get("MCORE_DESELECT") and os.path.exists(os.environ["MCORE_DESELECT"]):
        done = set(Path(os.environ["MCORE_DESELECT"]).read_text().split("\n"))
    keep, drop = [], []
    for item in items:
        (drop if item.nodeid in done else keep).append(item)
        if item.nodeid in done:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        cuda_param = any(isinstance(v, str) and v == "cuda" for v in params.values())
        try:
            src = inspect.getsource(item.function)
        except (OSError, TypeError):
            src = ""
        if cuda_param or _CUDA_SRC.search(src):
            item.add_marker(pytest.mark.skip(reason="cuda-only (CPU harness)"))
        elif params.get("persistent") is True:
            # PersistentAsyncCaller spawns a fresh worker (no shims) that calls
            # torch.cuda.set_device(rank % torch.cuda.device_count()): hangs on CPU.
            item.add_marker(pytest.mark.skip(
                reason="cuda-only: persistent async worker sets a CUDA device"))
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _write(record):
    if not RESULTS:
        return
    Path(RESULTS).mkdir(parents=True, exist_ok=True)
    with open(Path(RESULTS) / f"rank{RANK}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


_state: dict = {}


def pytest_runtest_logstart(nodeid, location):
    SAVES.update(torch_dist=0, moepec=0)
    _state[nodeid] = {"outcome": "passed", "error": None, "t0": time.time()}
    _write({"event": "start", "nodeid": nodeid, "rank": RANK})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """torch DCP's CheckpointException says only which ranks failed: keep the first
    rank's own exception in the record."""
    report = yield
    exc = call.excinfo.value if call.excinfo is not None else None
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = sorted(failures.items())[0]
        inner = getattr(inner, "exc", inner)  # torch's _WrappedException
        first = (str(inner).strip().splitlines() or [""])[0]
        report.mcore_error = (f"{type(exc).__name__} (rank {rank}): "
                              f"{type(inner).__name__}: {first}")
    return report


def pytest_runtest_logreport(report):
    st = _state.setdefault(report.nodeid, {"outcome": "passed", "error": None,
                                          "t0": time.time()})
    if report.skipped and report.when in ("setup", "call"):
        st["outcome"] = "skipped"
        lr = report.longrepr
        st["error"] = lr[2] if isinstance(lr, tuple) else str(lr)
    elif report.failed and st["outcome"] != "failed":
        st["outcome"] = "failed" if report.when == "call" else f"error-{report.when}"
        crash = getattr(report.longrepr, "reprcrash", None)
        msg = crash.message if crash is not None else str(report.longrepr)
        st["error"] = getattr(report, "mcore_error", None) or msg


def pytest_runtest_logfinish(nodeid, location):
    st = _state.pop(nodeid, {"outcome": "passed", "error": None, "t0": time.time()})
    _write({"event": "finish", "nodeid": nodeid, "rank": RANK, "outcome": st["outcome"],
            "error": st["error"], "saves": dict(SAVES),
            "seconds": round(time.time() - st["t0"], 2)})
