"""Server-sent events in the Anthropic stream format: `event: <type>` then `data: <json>`."""

from __future__ import annotations

import json
from typing import Any

PING = b'event: ping\ndata: {"type": "ping"}\n\n'


def sse_event(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()
