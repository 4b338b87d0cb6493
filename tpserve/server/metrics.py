"""Prometheus metrics: one ``CollectorRegistry`` per app, never the process-global default.

Request-level series (outcomes, token counts, TTFT, inter-token latency) are updated on the
event loop as events arrive. Engine-level series (queue lengths, KV pages, allreduce calls
and time per backend, speculative acceptance) are read from one engine snapshot taken on the
engine thread when ``/metrics`` is scraped, and exposed through a custom collector, so the
engine loop itself does no metrics work.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tpserve.server.engine_client import EngineClient, EngineUnavailable
from tpserve.server.state import _engine_snapshot

TTFT_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (.001, .0025, .005, .01, .02, .04, .08, .16, .32, .64, 1.28, 2.5, 5)
# Label values come from fixed sets, so made-up methods or paths cannot grow /metrics.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
OTHER = "other"


class EngineCollector(Collector):
    """Series derived from the latest engine snapshot (empty until the first scrape)."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}

    def collect(self) -> Iterator[Any]:
        snap = self.snapshot
        if not snap:
            return
        yield _gauge("tpserve_num_running_requests", "requests in the running batch",
                     snap.get("num_running_reqs", 0))
        yield _gauge("tpserve_num_waiting_requests", "requests waiting for admission",
                     snap.get("num_waiting_reqs", 0))
        total, free = snap.get("kv_pages_total", 0), snap.get("kv_pages_free", 0)
        yield _gauge("tpserve_kv_pages_used", "KV cache pages in use", total - free)
        yield _gauge("tpserve_kv_pages_total", "usable KV cache pages", total)
        cache = snap.get("prefix_cache") or {}
        if cache:
            yield _gauge("tpserve_kv_pages_cached", "KV pages held by the prefix cache "
                         "(reusable; evicted when needed)", cache["pages"])
            yield _gauge("tpserve_prefix_cache_hit_rate", "prompt tokens served from cached "
                         "pages / prompt tokens admitted", cache["hit_rate"])
        yield from _allreduce(snap.get("allreduce_stats") or {})
        yield from _speculative((snap.get("engine") or {}).get("extra") or {})
        yield from _adaptive((snap.get("engine") or {}).get("extra") or {})
        yield from _profile(snap.get("profile") or {})


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


def _allreduce(stats: dict[str, Any]) -> Iterator[Any]:
    calls = CounterMetricFamily("tpserve_allreduce_calls", "allreduce calls on rank 0",
                                labels=["backend"])
    seconds = CounterMetricFamily("tpserve_allreduce_seconds",
                                  "time in allreduce on rank 0 (on CUDA only while "
                                  "profiling: timing there needs a device sync)", labels=["backend"])
    waited = CounterMetricFamily("tpserve_allreduce_wait_seconds",
                                 "part of tpserve_allreduce_seconds rank 0 spent waiting for a late "
                                 "rank (backends that can tell: shm)", labels=["backend"])
    for name, snap in stats.items():
        if isinstance(snap, dict):
            calls.add_metric([name], float(snap.get("calls", 0)))
            seconds.add_metric([name], float(snap.get("seconds", 0.0)))
            waited.add_metric([name], float(snap.get("waited_seconds", 0.0)))
    yield calls
    yield seconds
    yield waited


def _speculative(extra: dict[str, Any]) -> Iterator[Any]:
    """EAGLE statistics when speculative decoding is on; read defensively (shape may grow)."""
    spec = extra.get("spec")
    if not isinstance(spec, dict):
        return
    if isinstance(spec.get("avg_accept_length"), (int, float)):
        yield _gauge("tpserve_spec_accept_length",
                     "mean tokens committed per verify step (1 + accepted drafts)",
                     spec["avg_accept_length"])
    rates = spec.get("position_accept_rate")
    if isinstance(rates, list):
        family = GaugeMetricFamily("tpserve_spec_position_accept_rate",
                                   "fraction of verify steps accepting the draft at this depth",
                                   labels=["position"])
        for depth, rate in enumerate(rates):
            family.add_metric([str(depth)], float(rate))
        yield family


def _adaptive(extra: dict[str, Any]) -> Iterator[Any]:
    """Adaptive speculation: the setting chosen now, its predicted and measured tok/s."""
    snap = extra.get("spec_adaptive")
    if not isinstance(snap, dict):
        return
    yield _gauge("tpserve_spec_adaptive_enabled", "1 while the adaptive chooser drives "
                 "the speculative settings", 1.0 if snap.get("enabled") else 0.0)
    choice = GaugeMetricFamily("tpserve_spec_adaptive_choice",
                               "1 for the setting the chooser runs now (off = plain decoding)",
                               labels=["setting"])
    choice.add_metric([str(snap.get("choice"))], 1.0)
    yield choice
    # NaN until the chooser has a number for the setting at this batch size (a gauge that
    # comes and goes breaks dashboards and alerts).
    for key, doc in (("predicted_tok_s", "predicted tok/s of the chosen setting (NaN: none yet)"),
                     ("measured_tok_s", "measured tok/s of the chosen setting, moving mean "
                                        "(NaN: none yet)")):
        value = snap.get(key)
        yield _gauge(f"tpserve_spec_adaptive_{key}", doc,
                     float(value) if isinstance(value, (int, float)) else math.nan)
    yield _gauge("tpserve_spec_adaptive_switches", "setting changes made on predictions",
                 float(snap.get("switches", 0)))


def _profile(prof: dict[str, Any]) -> Iterator[Any]:
    """Step profiler (``--enable-profiling``): mean ms per step by phase, allreduces by phase."""
    if not prof.get("steps"):
        return
    yield _gauge("tpserve_step_ms", "mean engine step time (profiled steps)", prof["step_ms_avg"])
    phases = GaugeMetricFamily("tpserve_phase_ms_per_step", "mean ms per step spent in a phase",
                               labels=["phase"])
    for name, entry in prof.get("phases", {}).items():
        phases.add_metric([name], float(entry["ms_per_step"]))
    yield phases
    ar_ms = GaugeMetricFamily("tpserve_phase_allreduce_ms_per_step",
                              "allreduce ms per step issued from a phase", labels=["phase"])
    ar_calls = GaugeMetricFamily("tpserve_phase_allreduce_calls_per_step",
                                 "allreduce calls per step issued from a phase", labels=["phase"])
    ar_wait = GaugeMetricFamily("tpserve_phase_allreduce_wait_ms_per_step",
                                "of the allreduce ms per step, waiting for a late rank",
                                labels=["phase"])
    for name, entry in prof.get("allreduce", {}).items():
        ar_ms.add_metric([name], float(entry["ms_per_step"]))
        ar_calls.add_metric([name], float(entry["calls_per_step"]))
        ar_wait.add_metric([name], float(entry.get("wait_ms_per_step", 0.0)))
    yield ar_ms
    yield ar_calls
    yield ar_wait


class ServerMetrics:
    """Implements ``RequestObserver`` for the engine client and renders ``/metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter("tpserve_requests", "finished sequences by outcome "
                                "(stop, length, abort, cancelled, rejected)", ["outcome"],
                                registry=reg)
        self.prompt_tokens = Counter("tpserve_prompt_tokens", "prompt tokens of finished "
                                     "sequences", registry=reg)
        self.generation_tokens = Counter("tpserve_generation_tokens", "generated tokens",
                                         registry=reg)
        self.ttft = Histogram("tpserve_time_to_first_token_seconds", "arrival to first token",
                              buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("tpserve_inter_token_latency_seconds", "gap between output "
                             "tokens (a multi-token event counts its gap split evenly)",
                             buckets=ITL_BUCKETS, registry=reg)
        self.http = Counter("tpserve_http_responses", "HTTP responses by path and status",
                            ["method", "path", "status"], registry=reg)
        self.engine = EngineCollector()
        reg.register(self.engine)
        self.paths: frozenset[str] = frozenset()  # the app's route table (track_routes)

    def track_routes(self, paths: frozenset[str]) -> None:
        """Paths counted under their own label; any other path is counted as ``other``."""
        self.paths = paths

    def on_tokens(self, started: float, previous: float | None, now: float, count: int) -> None:
        if previous is None:
            self.ttft.observe(now - started)
            count -= 1
            previous = now
        for _ in range(count):
            self.itl.observe((now - previous) / max(1, count))

    def on_finish(self, outcome: str, prompt_tokens: int, output_tokens: int) -> None:
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)

    def on_rejected(self, count: int) -> None:
        self.requests.labels("rejected").inc(count)

    def on_response(self, method: str, path: str, status: int) -> None:
        self.http.labels(method if method in HTTP_METHODS else OTHER,
                         path if path in self.paths else OTHER, str(status)).inc()

    async def render(self, client: EngineClient) -> bytes:
        try:
            self.engine.snapshot = await client.call(_engine_snapshot, timeout=5.0)
        except EngineUnavailable:
            pass  # keep the last snapshot: a dead engine must not make scraping fail
        return generate_latest(self.registry)
