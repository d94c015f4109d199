"""GET /metrics: Prometheus metrics under vLLM's names (``vllm:`` becomes ``ignition:``), and request log lines.

Each app has its own registry. Gauges are read from the engine when scraped; counters and
histograms are updated by each request's ``RequestRecord`` as its tokens arrive and when it
finishes (``finished_reason``: stop, length, abort for a client that went away, error).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("ignition.serve")

# vLLM's buckets (vllm/v1/metrics/loggers.py)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))
ENGINE_COUNTERS = (("prefill_chunks", "Prompt chunks the engine prefilled (every prefill, scored or mixed submission "
                    "of a prompt chunk)."),
                   ("prompt_tokens_prefilled", "Prompt tokens the engine prefilled: a prompt shared by n samples "
                    "counts once, where prompt_tokens counts it per sample."),
                   ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
                   ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."))
"""Ignition's own counters, read from the engine's ``stats`` when scraped (``AsyncEngine.load``)."""


class _EngineCounters(Collector):
    def __init__(self, model_name: str, load: Callable[[], dict[str, int]]):
        self.model_name, self.load = model_name, load

    def describe(self):
        return [CounterMetricFamily(f"ignition:{name}", doc, labels=["model_name"]) for name, doc in ENGINE_COUNTERS]

    def collect(self):
        counts = self.load()
        for name, doc in ENGINE_COUNTERS:
            family = CounterMetricFamily(f"ignition:{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], counts[name])
            yield family


class ServerMetrics:
    """The app's metrics; ``load`` returns the engine's counts (``AsyncEngine.load``)."""

    def __init__(self, model_name: str, load: Callable[[], dict[str, int]], log_requests: bool = True):
        self.registry = registry = CollectorRegistry()
        self.model_name, self.log_requests = model_name, log_requests
        model = ["model_name"]
        for name, key, doc in (("num_requests_running", "running", "Requests in engine lanes."),
                               ("num_requests_waiting", "waiting", "Requests waiting for a lane."),
                               ("kv_cache_usage_perc", "kv_cache_usage_perc",
                                "KV-cache usage. 1 means 100 percent usage."),
                               ("state_snapshot_bytes", "state_snapshot_bytes",
                                "Host bytes of the linear-attention state snapshots prefix hits resume.")):
            gauge = Gauge(f"ignition:{name}", doc, model, registry=registry)
            gauge.labels(model_name).set_function(lambda key=key: load()[key])
        registry.register(_EngineCounters(model_name, load))
        self.prompt_tokens = Counter("ignition:prompt_tokens", "Prompt tokens admitted.", model,
                                     registry=registry).labels(model_name)
        self.generation_tokens = Counter("ignition:generation_tokens", "Generated tokens delivered.", model,
                                         registry=registry).labels(model_name)
        self.success = Counter("ignition:request_success", "Finished requests by finish reason.",
                               model + ["finished_reason"], registry=registry)
        self.e2e = Histogram("ignition:e2e_request_latency_seconds", "Request latency, admission to finish.", model,
                             buckets=LATENCY_BUCKETS, registry=registry).labels(model_name)
        self.ttft = Histogram("ignition:time_to_first_token_seconds", "Admission to the first generated token.",
                              model, buckets=TTFT_BUCKETS, registry=registry).labels(model_name)
        self.request_prompt = Histogram("ignition:request_prompt_tokens", "Prompt tokens per request.", model,
                                        buckets=TOKEN_BUCKETS, registry=registry).labels(model_name)
        self.request_generation = Histogram("ignition:request_generation_tokens", "Generated tokens per request.",
                                            model, buckets=TOKEN_BUCKETS, registry=registry).labels(model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def start(self, request_id: str, prompt_tokens: int) -> RequestRecord:
        self.prompt_tokens.inc(prompt_tokens)
        self.request_prompt.observe(prompt_tokens)
        return RequestRecord(self, request_id, prompt_tokens)


class RequestRecord:
    """One admitted request's timings; ``finish`` runs once, whatever ends the request."""

    def __init__(self, metrics: ServerMetrics, request_id: str, prompt_tokens: int):
        self.metrics, self.request_id, self.prompt_tokens = metrics, request_id, prompt_tokens
        self.started = time.monotonic()
        self.first_token: float | None = None
        self.generated = 0
        self.finished = False

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        if self.first_token is None:
            self.first_token = time.monotonic() - self.started
            self.metrics.ttft.observe(self.first_token)
        self.generated += count
        self.metrics.generation_tokens.inc(count)

    def finish(self, reason: str) -> None:
        if self.finished:
            return
        self.finished = True
        metrics, latency = self.metrics, time.monotonic() - self.started
        metrics.e2e.observe(latency)
        metrics.request_generation.observe(self.generated)
        metrics.success.labels(metrics.model_name, reason).inc()
        if metrics.log_requests:
            first = "-" if self.first_token is None else f"{self.first_token:.3f} s"
            log.info("%s finished (%s): %d prompt tokens, %d generated tokens, %.3f s, first token %s",
                     self.request_id, reason, self.prompt_tokens, self.generated, latency, first)
