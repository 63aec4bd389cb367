"""A CPU shim for Lightning 2.6's ``DeepSpeedStrategy``, for the tests only (never the
library). Lightning assumes CUDA in two places of it: ``setup_environment`` refuses every
accelerator but CUDA, and each rank's device index must be its local rank (checked in
``setup_distributed``, handed to ``deepspeed.initialize`` as ``device_rank``), which a
plain CPU device lacks. The rest of the strategy -- ``deepspeed.initialize``,
``save_checkpoint`` into a ``<name>.ckpt`` folder with the tag ``checkpoint``,
``load_checkpoint`` on a resume -- runs as it is, on DeepSpeed's CPU accelerator
(``DS_ACCELERATOR=cpu``) and gloo."""

from __future__ import annotations

import torch
from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy


class CpuDeepSpeedStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` without its two CUDA assumptions."""

    def setup_environment(self) -> None:
        # DeepSpeedStrategy.setup_environment is the CUDA check, then DDPStrategy's
        # (the accelerator's device, then this strategy's setup_distributed).
        DDPStrategy.setup_environment(self)

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        # CPU devices numbered by local rank, as CUDA devices are ("cpu:1" is the CPU).
        self._parallel_devices = None if devices is None else \
            [torch.device("cpu", i) for i in range(len(devices))]
