"""Prometheus metrics of the server, through ``prometheus_client``.

Names follow vLLM's (``vllm:num_requests_running`` ...) under the ``mlx_ferrum:`` prefix.
Gauges that mirror engine state (running and waiting requests, KV-cache usage, prefix
cache hits) are read from :meth:`Engine.stats` at scrape time by a custom collector, so
they can never drift from the engine; per-request histograms and counters are recorded
by the server as each request finishes. Each :class:`ServerMetrics` has its own
registry, so several apps can live in one process (tests).

Served, with ``GET /health`` (200 while the engine runs, 503 while shutting down or
after the engine loop stopped), by :func:`monitoring_router`: both answer without the
API key, for load balancers and scrapers.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets (seconds) as vLLM's, which span Metal-GPU and CPU-backend latencies.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class _EngineCollector:
    """Yields the engine-state gauges from ``engine.stats()`` at each scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        running = GaugeMetricFamily("mlx_ferrum:num_requests_running", "Requests in the running batch.")
        running.add_metric([], s["num_running"])
        waiting = GaugeMetricFamily("mlx_ferrum:num_requests_waiting", "Requests waiting to be scheduled.")
        waiting.add_metric([], s["num_waiting"])
        total, used = s.get("kv_blocks_total"), s.get("kv_blocks_used")
        usage = GaugeMetricFamily("mlx_ferrum:kv_cache_usage_perc", "Share of KV-cache blocks in use (0-1; 0 for the contiguous layout).")
        usage.add_metric([], (used / total) if total else 0.0)
        blocks = GaugeMetricFamily("mlx_ferrum:kv_cache_used_blocks", "KV-cache blocks in use.")
        blocks.add_metric([], used or 0)
        # bytes as stored, so a quantized cache (kv_cache_dtype int8/int4) shows what it saves
        dtype = str(s["kv"].get("kv_cache_dtype", "auto"))
        kv_bytes = []
        for key, name, doc in (("allocated_bytes", "kv_cache_allocated_bytes", "Bytes of the KV cache's storage, scales included."),
                               ("used_bytes", "kv_cache_used_bytes", "Bytes of the KV blocks (or buffers) in use, scales included."),
                               ("bytes_per_token", "kv_cache_bytes_per_token", "K and V bytes of one token over all layers, as stored.")):
            gauge = GaugeMetricFamily(f"mlx_ferrum:{name}", doc, labels=["kv_cache_dtype"])
            gauge.add_metric([dtype], s["kv"].get(key, 0) or 0)
            kv_bytes.append(gauge)
        hit_rate = GaugeMetricFamily("mlx_ferrum:prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up.")
        hit_rate.add_metric([], s.get("prefix_cache_hit_rate") or 0.0)
        hits = CounterMetricFamily("mlx_ferrum:prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        hits.add_metric([], s["kv"].get("prefix_hit_tokens", 0))
        preempt = CounterMetricFamily("mlx_ferrum:num_preemptions", "Sequences preempted and recomputed.")
        preempt.add_metric([], s["num_preemptions"])
        generated = CounterMetricFamily("mlx_ferrum:generation_tokens", "Tokens generated (every request, aborted ones included).")
        generated.add_metric([], s["generated_tokens"])
        prefilled = CounterMetricFamily("mlx_ferrum:prompt_tokens", "Prompt tokens run through the model (prefix-cache hits excluded).")
        prefilled.add_metric([], s["prefilled_tokens"])
        cut = CounterMetricFamily("mlx_ferrum:structured_output_length_finishes",
                                  "Constrained (structured-output) requests cut by max_tokens or the context before their "
                                  "grammar was complete: their output does not parse.")
        cut.add_metric([], s.get("structured_length_finishes", 0))
        # speculative decoding, under vLLM's spec_decode names (all 0 when it is off)
        drafts = CounterMetricFamily("mlx_ferrum:spec_decode_num_drafts", "Verified rows that carried proposed tokens.")
        drafts.add_metric([], s.get("spec_num_drafts", 0))
        draft_tokens = CounterMetricFamily("mlx_ferrum:spec_decode_num_draft_tokens", "Tokens proposed by the speculative proposer.")
        draft_tokens.add_metric([], s.get("spec_proposed_tokens", 0))
        accepted = CounterMetricFamily("mlx_ferrum:spec_decode_num_accepted_tokens", "Proposed tokens the target model accepted.")
        accepted.add_metric([], s.get("spec_accepted_tokens", 0))
        return [running, waiting, usage, blocks, *kv_bytes, hit_rate, hits, preempt, generated, prefilled, cut,
                drafts, draft_tokens, accepted] + self._lora()

    def _lora(self) -> list:
        """Adapter families (only when LoRA is on): requests per adapter, adapters loaded
        and resident, loads and slot evictions."""
        snapshot = self.engine.lora_metrics_snapshot()
        if not snapshot:
            return []
        requests = CounterMetricFamily("mlx_ferrum:lora_requests", "Requests admitted per LoRA adapter.",
                                       labels=["lora_name"])
        for name, count in snapshot["requests"].items():
            requests.add_metric([name], count)
        loaded = GaugeMetricFamily("mlx_ferrum:lora_loaded_adapters", "LoRA adapters held in memory.")
        loaded.add_metric([], len(snapshot["loaded"]))
        resident = GaugeMetricFamily("mlx_ferrum:lora_resident_adapters", "LoRA adapters in batch slots (at most max_loras).")
        resident.add_metric([], len(snapshot["resident"]))
        waiting = GaugeMetricFamily("mlx_ferrum:lora_requests_waiting_for_slot", "Requests waiting for a free LoRA slot.")
        waiting.add_metric([], snapshot.get("waiting_for_slot", 0))
        loads = CounterMetricFamily("mlx_ferrum:lora_loads", "LoRA adapters read from disk.")
        loads.add_metric([], snapshot["loads"])
        evictions = CounterMetricFamily("mlx_ferrum:lora_slot_evictions", "LoRA adapters evicted from a batch slot.")
        evictions.add_metric([], snapshot["slot_evictions"])
        return [requests, loaded, resident, waiting, loads, evictions]


class ServerMetrics:
    """The server's Prometheus registry.

    Args:
        engine: the :class:`~mlx_ferrum.engine.Engine` whose ``stats()`` feeds the gauges.
    """

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        r = self.registry
        self.ttft = Histogram("mlx_ferrum:time_to_first_token_seconds", "Time to first token (s).", buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("mlx_ferrum:inter_token_latency_seconds", "Time between consecutive output tokens (s).", buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("mlx_ferrum:e2e_request_latency_seconds", "Arrival to finish (s).", buckets=_E2E_BUCKETS, registry=r)
        self.finished = Counter("mlx_ferrum:request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r)
        self.http_errors = Counter("mlx_ferrum:http_errors", "Requests answered with an error, by status code.", ["status"], registry=r)

    def observe_finished(self, out) -> None:
        """Record one finished :class:`~mlx_ferrum.engine.RequestOutput`."""
        m = out.metrics
        self.finished.labels(finished_reason=out.finish_reason or "unknown").inc()
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for gap in m.inter_token_latencies:
            self.itl.observe(gap)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    def observe_aborted(self) -> None:
        """Record a request whose stream was closed before its final output (client left)."""
        self.finished.labels(finished_reason="abort").inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


def monitoring_router(serving, metrics: ServerMetrics) -> APIRouter:
    """``GET /health`` (:meth:`~mlx_ferrum.server.serving.OpenAIServing.check_alive` of
    ``serving``) and ``GET /metrics`` (``metrics``, Prometheus' text format)."""
    router = APIRouter()

    @router.get("/health")
    async def health():
        serving.check_alive()
        return Response(status_code=200)

    @router.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return router
