"""A server bound to loopback answers only requests addressed to this machine.

Loopback keeps other machines out, but not the web pages this machine's browser opens: a page
can POST to http://127.0.0.1:PORT (a text/plain body needs no CORS preflight), and with DNS
rebinding (its own host name re-pointed at 127.0.0.1) read the answers too. Such a request
names the page's host in `Host`, or carries the page's `Origin`; a client on this machine
(Claude Code, the SDK, curl) names a loopback host and sends no foreign Origin. So, on a
loopback server without tokens, a request whose Host or Origin is not this machine is refused
with a 403. Where tokens are required a page has none to send (a 401), and a reverse proxy on
this machine may pass on its public Host: the tokens decide there.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from ikcode.auth import is_loopback
from ikcode.gateway.settings import GatewaySettings


def same_machine_only(settings: GatewaySettings) -> bool:
    """Whether the server answers only requests addressed to this machine."""
    return settings.bind_loopback and not settings.auth_tokens


def _hostname(url: str) -> str | None:
    """The host of a URL ("http://localhost:3000") or of "//" + a Host value ("//[::1]:80");
    None when it cannot be parsed (urlsplit refuses "[", "[evil]"): not this machine."""
    try:
        return (urlsplit(url).hostname or "").rstrip(".").lower()
    except ValueError:
        return None


def is_this_machine(hostname: str | None) -> bool:
    """localhost (and *.localhost, RFC 6761), a loopback address, the unspecified address
    (http://0.0.0.0:PORT reaches a loopback listener on Linux and macOS; an address is no
    rebinding target, and a page's requests carry its Origin), or this machine's own name
    (which /etc/hosts commonly maps to 127.0.1.1)."""
    if hostname is None:
        return False
    if hostname == "localhost" or hostname.endswith(".localhost") or is_loopback(hostname):
        return True
    try:
        if ipaddress.ip_address(hostname).is_unspecified:
            return True
    except ValueError:
        pass
    return hostname == socket.gethostname().lower()


def foreign_request(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """Why a request to a loopback server is not from this machine, or None when it may be."""
    seen = {name.lower(): value.decode("latin-1") for name, value in headers}
    host = seen.get(b"host")
    if host is not None and not is_this_machine(_hostname(f"//{host}")):
        return (
            f"this server listens on loopback and answers only requests addressed to this machine "
            f"(Host {host[:100]!r}); use http://127.0.0.1 or http://localhost"
        )
    origin = seen.get(b"origin")
    if origin is not None and not is_this_machine(_hostname(origin)):
        return (
            f"this server listens on loopback and does not answer web pages from other sites "
            f"(Origin {origin[:100]!r})"
        )
    return None
