"""Prometheus metrics of one controller (own registry, so two apps in one process don't collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import Enum as EnumMetric

STATES = ("loading", "running", "paused", "sleeping", "weights-invalid", "failed", "restarting")

# Latency buckets from a 1 ms decode step on GPU to minutes-long CPU prefills.
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("latentserve_requests", "HTTP generation requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("latentserve_prompt_tokens", "prompt tokens of finished requests",
                                     registry=r)
        self.generation_tokens = Counter("latentserve_generation_tokens", "generated tokens", registry=r)
        self.in_flight = Gauge("latentserve_requests_in_flight", "generation requests being served",
                               registry=r)
        self.request_latency = Histogram("latentserve_request_latency_seconds", "arrival to last token",
                                         ["endpoint"], buckets=_LATENCY, registry=r)
        self.ttft = Histogram("latentserve_time_to_first_token_seconds", "arrival to first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("latentserve_inter_token_latency_seconds", "time between generated tokens",
                             buckets=_LATENCY, registry=r)
        self.transition_seconds = Histogram(
            "latentserve_transition_seconds", "sleep / wake_up / update_weights round trip in the controller",
            ["op", "outcome"], buckets=_LATENCY, registry=r)
        self.state = EnumMetric("latentserve_state", "lifecycle state of the model", states=list(STATES),
                                registry=r)
        self.weight_version = Gauge("latentserve_weight_version", "version of the weights being served",
                                    registry=r)
        self.ranks_alive = Gauge("latentserve_ranks_alive", "ranks answering the health watcher", registry=r)
        self.state.state("loading")

    def set_state(self, name: str) -> None:
        self.state.state(name if name in STATES else "failed")

    def render(self) -> bytes:
        return generate_latest(self.registry)
