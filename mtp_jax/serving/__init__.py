"""Serving: continuous batching with MTP speculation (`ServingEngine`), and the OpenAI-compatible
HTTP server around it (`mtp_jax.serving.server`, `mtp-jax serve`)."""

from mtp_jax.serving.engine import QueueFull, RequestMetrics, RequestOutput, ServingEngine

__all__ = ["QueueFull", "RequestMetrics", "RequestOutput", "ServingEngine"]
