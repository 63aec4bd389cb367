"""A test-only stand-in for Transformer Engine 2.6 (which does not install on a CPU-only
machine), so that Megatron-Core's own TE classes exist: ``TEGroupedMLP`` and its
``TEGroupedLinear._sharded_state_dict_grouped`` (megatron/core/extensions/
transformer_engine.py), which Megatron defines only when a ``transformer_engine`` >= 1.9
imports. It stands in for what TE itself owns and nothing more: ``GroupedLinear``'s
parameters (``weight<i>``, ``bias<i>``: TE's names) and its FP8 extra state (TE 2.x's
pickled dict as a uint8 tensor, delayed scaling: 3 forward and 2 backward scales per
GEMM), which Megatron splits per expert. Every sharded key, offset and factory is
Megatron's own code. No forward runs (the GEMMs are CUDA kernels).

``install()`` puts the package in ``sys.modules``: call it before anything imports
megatron, in a process of its own (it turns TE on for the whole process)."""

from __future__ import annotations

import pickle
import sys
import types
from dataclasses import dataclass

import torch

VERSION = "2.6.0"  # >= 2.3 (Megatron's TE 2 paths), < 2.7 (its fused-router import)
AMAX_HISTORY = 4


class _Module(torch.nn.Module):
    """A TE module Megatron subclasses but this test never builds."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("the TE stand-in only builds GroupedLinear")


class LayerNorm(torch.nn.LayerNorm):
    """te.pytorch.LayerNorm (Megatron's TENorm, e.g. the decoder's final norm): torch's,
    with TE's parameter names (``weight``, ``bias``)."""

    def __init__(self, hidden_size, eps=1e-5, *, params_dtype=torch.float32, device="cpu",
                 **_te_kwargs):
        super().__init__(hidden_size, eps=eps, dtype=params_dtype, device=device)


@dataclass
class DelayedScaling:
    """te.common.recipe.DelayedScaling (its fields that Megatron reads)."""
    margin: int = 0
    fp8_format: object = None
    amax_history_len: int = AMAX_HISTORY
    amax_compute_algo: str = "max"
    override_linear_precision: object = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False


class GroupedLinear(torch.nn.Module):
    """te.pytorch.GroupedLinear's state: ``num_gemms`` weights ``[out, in]`` named
    ``weight<i>`` (and ``bias<i>``), initialised by ``init_method``, and FP8 delayed
    scaling state as TE 2.x keeps it: one extra state for all GEMMs."""

    def __init__(self, num_gemms, in_features, out_features, *, init_method=None,
                 bias=True, params_dtype=torch.float32, device="cpu", **_te_kwargs):
        super().__init__()
        self.num_gemms, self.use_bias = num_gemms, bias
        for i in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype,
                                               device=device))
            if init_method is not None:
                init_method(w)
            self.register_parameter(f"weight{i}", w)
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(
                    torch.zeros(out_features, dtype=params_dtype, device=device)))
        self.fp8, self.fp8_calibration = False, False
        self.fp8_meta = {"fp8_checkpoint": True, "recipe": DelayedScaling()}
        self.fp8_state = {  # per GEMM: 3 forward and 2 backward tensors' scales
            "scale_fwd": torch.ones(3 * num_gemms),
            "amax_history_fwd": torch.zeros(AMAX_HISTORY, 3 * num_gemms),
            "scale_bwd": torch.ones(2 * num_gemms),
            "amax_history_bwd": torch.zeros(AMAX_HISTORY, 2 * num_gemms)}

    def init_fp8_metadata(self, num_gemms=1):
        pass

    def get_extra_state(self) -> torch.Tensor:
        state = {"recipe": self.fp8_meta["recipe"],
                 "extra_fp8_variables": {"num_gemms": self.num_gemms},
                 **{k: v.clone() for k, v in self.fp8_state.items()}}
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state: torch.Tensor) -> None:
        if state.numel() == 0:
            return
        # TE's own format, in the test's process (moepec never unpickles: it stores the
        # uint8 tensor Megatron gives it)
        decoded = pickle.loads(state.numpy().tobytes())
        for key in self.fp8_state:
            self.fp8_state[key] = decoded[key].reshape(self.fp8_state[key].shape).clone()


DelayedScaling.__module__ = "transformer_engine.common.recipe"


class QuantizedTensor(torch.Tensor):
    """TE 2.x's base of FP8 tensors: no tensor here is one."""


class CudaRNGStatesTracker:
    def __init__(self, *args, **kwargs):
        self.states_ = {}


def install() -> None:
    """Put the stand-in ``transformer_engine`` package into ``sys.modules``."""
    if "transformer_engine" in sys.modules:
        return
    if "megatron.core" in sys.modules:
        raise RuntimeError("install the TE stand-in before importing megatron")

    def module(name: str, **attrs) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        return mod

    fp8 = module("transformer_engine.pytorch.fp8", FP8GlobalStateManager=type(
        "FP8GlobalStateManager", (), {"is_fp8_enabled": staticmethod(lambda: False)}),
        fp8_autocast=None)
    ops = module("transformer_engine.pytorch.ops", **{  # used in annotations only
        name: _Module for name in ("Sequential", "FusibleOperation", "BasicLinear", "Bias")})
    distributed = module("transformer_engine.pytorch.distributed",
                         CudaRNGStatesTracker=CudaRNGStatesTracker,
                         activation_recompute_forward=None)
    tensor = module("transformer_engine.pytorch.tensor", QuantizedTensor=QuantizedTensor)
    tensor.__path__ = []
    pytorch = module("transformer_engine.pytorch", fp8=fp8, tensor=tensor, ops=ops,
                     distributed=distributed, GroupedLinear=GroupedLinear,
                     Linear=_Module, LayerNormLinear=_Module, DotProductAttention=_Module,
                     LayerNorm=LayerNorm, RMSNorm=_Module)
    pytorch.__path__ = []
    recipe = module("transformer_engine.common.recipe", DelayedScaling=DelayedScaling)
    common = module("transformer_engine.common", recipe=recipe)
    common.__path__ = []
    te = module("transformer_engine", __version__=VERSION, pytorch=pytorch, common=common)
    te.__path__ = []
