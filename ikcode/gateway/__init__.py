"""The Anthropic Messages API in front of any Engine: schemas, rendering, SSE, errors, metrics."""

from ikcode.gateway.app import create_app
from ikcode.gateway.server import BackgroundServer, run_server
from ikcode.gateway.settings import GatewaySettings

__all__ = ["BackgroundServer", "GatewaySettings", "create_app", "run_server"]
