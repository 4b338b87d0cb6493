"""Pieces of ``launch.bench_moe``: exclusive-time scopes, the report, and the micro tables."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tpserve.engine.plan import Layout, build_forward_batch
from tpserve.layers.experts import ExpertStack
from tpserve.layers.mla import MLAttention
from tpserve.layers.mla_attention import BoundMLA, MLABackend
from tpserve.layers.mlp import GatedMLP
from tpserve.layers.moe import SparseMoE
from tpserve.layers.router import Router
from tpserve.layers.tp import TPContext
from tpserve.models.config import parse_config


class ScopeTimer:
    """Wall time per named scope, exclusive of nested scopes (CPU: ops are synchronous)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._stack: list[list[Any]] = []  # [name, start, time spent in children]

    def wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append([name, time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                scope, start, children = self._stack.pop()
                elapsed = time.perf_counter() - start
                self.totals[scope] = self.totals.get(scope, 0.0) + elapsed - children
                if self._stack:
                    self._stack[-1][2] += elapsed

        return timed

    def reset(self) -> None:
        self.totals.clear()

    def shares(self, seconds: float) -> dict[str, float]:
        out = {k: v / seconds for k, v in sorted(self.totals.items())}
        out["rest (embed, norms, engine)"] = 1.0 - sum(out.values())
        return out

    def per_step(self, steps: int) -> dict[str, float]:
        return {k: 1e3 * v / steps for k, v in sorted(self.totals.items())}


def install_timers(model: torch.nn.Module, comm: Any) -> ScopeTimer:
    timer = ScopeTimer()
    for module in model.modules():
        if isinstance(module, MLAttention):
            module.forward = timer.wrap(module.forward, "attention (MLA)")
        elif isinstance(module, Router):
            module.forward = timer.wrap(module.forward, "moe routing")
        elif isinstance(module, ExpertStack):
            module.forward = timer.wrap(module.forward, "expert dispatch")
            module.expert_mlp = timer.wrap(module.expert_mlp, "expert matmuls")
        elif isinstance(module, SparseMoE) and module.shared_experts is not None:
            shared = module.shared_experts
            shared.partial = timer.wrap(shared.partial, "shared experts")
        elif isinstance(module, GatedMLP):
            module.forward = timer.wrap(module.forward, "dense mlp")
    model.lm_head.forward = timer.wrap(model.lm_head.forward, "lm head")
    if comm is not None:
        comm.all_reduce = timer.wrap(comm.all_reduce, "allreduce")
        comm.all_gather = timer.wrap(comm.all_gather, "allreduce")
    return timer


def print_table(results: dict[str, Any]) -> None:
    runs = results["tp"]
    print(f"{'TP':>7}{'tok/s':>9}{'ms/step':>9}{'allreduces/step':>17}")
    for world, r in runs.items():
        print(f"{world:>7}{r['tok_s']:>9.1f}{r['step_ms']:>9.2f}{r['allreduces_per_step']:>17.1f}")
    scopes = sorted({s for r in runs.values() for s in r["scope_share"]})
    print(f"\nrank 0 time share per decode step (batch {results['batch']})")
    print(f"{'scope':<30}" + "".join(f"{'TP=' + str(w):>11}" for w in runs))
    for scope in scopes:
        print(f"{scope:<30}" + "".join(f"{r['scope_share'].get(scope, 0.0):>11.1%}"
                                       for r in runs.values()))


def _median_ms(fn: Callable[[], Any], repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _gather_bmm(stack: ExpertStack, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
    """The alternative design: gather each (token, slot)'s expert weights, batched matmul."""
    flat = ids.reshape(-1)
    xs = x.repeat_interleave(ids.shape[1], 0).unsqueeze(-1)
    gate, up = torch.bmm(stack.w13[flat], xs).squeeze(-1).split(stack.inter_local, -1)
    ys = torch.bmm(stack.w2[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
    return (ys.view(*ids.shape, -1) * w.unsqueeze(-1).to(ys.dtype)).sum(1)


def expert_path_table(shape: dict[str, Any]) -> dict[int, dict[str, float]]:
    cfg = parse_config({**shape, "architectures": ["DeepseekV3ForCausalLM"]})
    cpu, dtype = torch.device("cpu"), torch.bfloat16
    stack = ExpertStack(cfg.hidden_size, cfg.moe, TPContext.single(), dtype, cpu)
    router = Router(cfg.hidden_size, cfg.moe, cpu)
    torch.manual_seed(0)
    for p in (stack.w13, stack.w2, router.weight):
        p.data.normal_(0, 0.05)
    table: dict[int, dict[str, float]] = {}
    print(f"\nexpert compute, ms per MoE layer ({cfg.moe.num_experts} experts, top "
          f"{cfg.moe.top_k}, bf16, 1 thread)\n{'tokens':>7}{'sorted':>9}{'static':>9}"
          f"{'gather':>9}")
    for n in (1, 4, 16, 64, 256):
        x = torch.randn(n, cfg.hidden_size, dtype=dtype)
        w, ids = router(x)
        row = {"sorted": _median_ms(partial(stack.forward_sorted, x, w, ids)),
               "static": _median_ms(partial(stack.forward_static, x, w, ids)),
               "gather": _median_ms(partial(_gather_bmm, stack, x, w, ids))}
        table[n] = row
        print(f"{n:>7}" + "".join(f"{v:>9.2f}" for v in row.values()))
    return table


def _absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
              cache: torch.Tensor, attend: BoundMLA, scale: float, w_uk: torch.Tensor,
              w_uv: torch.Tensor) -> torch.Tensor:
    """What MLAttention does around the absorbed kernel: fold w_uk in, apply w_uv after."""
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
    out = attend.absorbed(q_lat, q_pe, latent, cache, scale)
    return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2))


def _expanded(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
              cache: torch.Tensor, attend: BoundMLA, scale: float, w_uk: torch.Tensor,
              w_uv: torch.Tensor) -> torch.Tensor:
    return attend.expanded(q_nope, q_pe, latent, cache, scale, w_uk, w_uv)


def _bound(cached: int, queries: int, latent_dim: int, dtype: torch.dtype) -> BoundMLA:
    """One request: ``cached`` tokens on pages 1.., then ``queries`` new ones."""
    pages = np.arange(1, 2 + (cached + queries) // 16, dtype=np.int32)[None]
    layout = Layout(np.zeros(queries, dtype=np.int64), np.array([queries], dtype=np.int32),
                    np.array([cached], dtype=np.int32), pages)
    fb = build_forward_batch(layout, 16, torch.device("cpu"))
    return MLABackend(latent_dim, dtype, torch.device("cpu")).bind(fb.attn)


def mla_path_table(shape: dict[str, Any], cached: int = 256) -> dict[int, dict[str, float]]:
    heads, c, r = shape["num_attention_heads"], shape["kv_lora_rank"], shape["qk_rope_head_dim"]
    nope, v, dtype = shape["qk_nope_head_dim"], shape["v_head_dim"], torch.bfloat16
    w_uk, w_uv = torch.randn(heads, nope, c, dtype=dtype), torch.randn(heads, v, c, dtype=dtype)
    cache = torch.zeros(cached + 528, 1, c + r, dtype=dtype)
    table: dict[int, dict[str, float]] = {}
    print(f"\nMLA attention, ms per layer ({heads} heads, {cached} cached tokens, bf16)\n"
          f"{'queries':>7}{'absorbed':>10}{'expanded':>10}")
    for q in (1, 4, 16, 32, 64, 256):
        attend = _bound(cached, q, c + r, dtype)
        q_nope = torch.randn(q, heads, nope, dtype=dtype)
        q_pe = torch.randn(q, heads, r, dtype=dtype)
        latent = torch.randn(q, c + r, dtype=dtype)
        args = (q_nope, q_pe, latent, cache, attend, 0.1, w_uk, w_uv)
        row = {"absorbed": _median_ms(partial(_absorbed, *args)),
               "expanded": _median_ms(partial(_expanded, *args))}
        table[q] = row
        print(f"{q:>7}" + "".join(f"{val:>10.2f}" for val in row.values()))
    return table
