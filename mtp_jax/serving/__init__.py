"""Serving: continuous batching with MTP speculation (`ServingEngine`) and its background-thread
driver (`AsyncEngine`), with no dependency beyond the core's; vLLM-named Prometheus metrics
(`mtp_jax.serving.prometheus.PrometheusMetrics`) and the OpenAI-compatible HTTP server around them
(`mtp_jax.serving.server`, `mtp-jax serve`) need the `serve` extra."""

from mtp_jax.serving.async_engine import AsyncEngine
from mtp_jax.serving.scheduler import QueueFull, RequestMetrics, RequestOutput, ServingEngine

__all__ = ["AsyncEngine", "QueueFull", "RequestMetrics", "RequestOutput", "ServingEngine"]
