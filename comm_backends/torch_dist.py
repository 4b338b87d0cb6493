"""Allreduce through ``torch.distributed``: NCCL on CUDA devices, gloo on CPU."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist

from comm_backends.base import AllReduce


class _TorchDistAllReduce(AllReduce):
    """Shared body: torch.distributed.all_reduce in place on ``group``."""

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        # NCCL refuses non-contiguous tensors ("Tensors must be contiguous"); the other
        # backends accept any layout, so reduce a contiguous copy and write it back.
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        dist.all_reduce(work, op=dist.ReduceOp.SUM, group=self.group)
        if work is not tensor:
            tensor.copy_(work)
        return tensor


class GlooAllReduce(_TorchDistAllReduce):
    name: ClassVar[str] = "gloo"
    devices: ClassVar[tuple[str, ...]] = ("cpu",)

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        # The default group may be NCCL-only on GPU jobs; a dedicated gloo group keeps this
        # backend usable for CPU tensors anywhere.
        if dist.is_initialized() and group is None:
            group = dist.new_group(backend="gloo")
        super().__init__(group, device)

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        # gloo sums bf16/fp16 pairwise in the input dtype, and the order can differ between
        # ranks; summing in fp32 keeps results accurate and bit-identical everywhere.
        if tensor.dtype in (torch.bfloat16, torch.float16):
            wide = tensor.float()
            dist.all_reduce(wide, op=dist.ReduceOp.SUM, group=self.group)
            tensor.copy_(wide)
            return tensor
        return super()._all_reduce(tensor)


class NcclAllReduce(_TorchDistAllReduce):
    name: ClassVar[str] = "nccl"
    devices: ClassVar[tuple[str, ...]] = ("cuda",)
    capture_safe: ClassVar[bool] = True

    @classmethod
    def environment_refusal(cls, device: torch.device) -> str | None:
        reason = super().environment_refusal(device)
        if reason is None and device.type == "cuda" and not torch.cuda.is_available():
            reason = "allreduce backend 'nccl' needs CUDA"
        if reason is None and not dist.is_nccl_available():
            reason = "allreduce backend 'nccl' needs a torch build with NCCL"
        return reason
