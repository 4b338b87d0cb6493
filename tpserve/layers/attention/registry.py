"""Attention backends by name (``--attention-backend``), imported lazily like comm_backends.

``auto`` picks, per device type, the first backend that can run the model's spec: on CPU the
native kernel (``cpu``) where it builds for this CPU and head size, on CUDA FlashInfer where it
is importable, and ``torch`` (gather + SDPA) everywhere else.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType

import torch

from tpserve.errors import ConfigError
from tpserve.layers.attention.base import AttentionBackend, AttentionSpec

FLAG = "--attention-backend"

BACKENDS: Mapping[str, str] = MappingProxyType({
    "torch": "tpserve.layers.attention.torch_backend:TorchAttention",
    "cpu": "tpserve.layers.attention.cpu_backend:CpuAttention",
    "flashinfer": "tpserve.layers.attention.flashinfer_backend:FlashInferAttention",
})

AUTO_ORDER: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"cpu": ("cpu", "torch"), "cuda": ("flashinfer", "torch")}
)

NAMES: tuple[str, ...] = ("auto", *BACKENDS)


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ConfigError(f"unknown attention backend '{name}' (known: {', '.join(NAMES)})",
                          flag=FLAG)
    module_name, cls_name = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def unavailable_reason(name: str, spec: AttentionSpec, device: torch.device) -> str | None:
    reason = backend_class(name).unavailable_reason(spec, device)
    return None if reason is None else f"attention backend '{name}': {reason}"


def available(spec: AttentionSpec, device: torch.device) -> list[str]:
    return [n for n in BACKENDS if unavailable_reason(n, spec, device) is None]


def resolve_auto(spec: AttentionSpec, device: torch.device) -> str:
    for name in AUTO_ORDER.get(device.type, ("torch",)):
        if unavailable_reason(name, spec, device) is None:
            return name
    raise ConfigError(f"no attention backend can run on {device.type}", flag=FLAG)


def create(name: str, spec: AttentionSpec, device: torch.device) -> AttentionBackend:
    """The backend ``name`` (or ``auto``'s choice) for ``spec`` on ``device``; ConfigError
    (one line, naming the flag) when it cannot run here."""
    if name == "auto":
        name = resolve_auto(spec, device)
    reason = unavailable_reason(name, spec, device)
    if reason is not None:
        raise ConfigError(reason, flag=FLAG)
    return backend_class(name)(spec, device)
