"""Upstream engines: existing Anthropic- or OpenAI-compatible servers (vLLM, SGLang, llama.cpp,
a remote endpoint), one or more replicas, behind ikcode's Anthropic Messages API."""

from .app import create_upstream_app
from .config import UpstreamConfig
from .router import Replica, Router

__all__ = ["Replica", "Router", "UpstreamConfig", "create_upstream_app"]
