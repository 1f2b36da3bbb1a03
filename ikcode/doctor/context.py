"""What every check reads: the profile, the endpoint, the token, the mode, where the log lives.

The endpoint check fills in what the server told it (model id, window), which later checks use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ikcode.doctor.client import EndpointClient
from ikcode.profiles import Profile

QUICK, FULL = "quick", "full"


@dataclass
class DoctorContext:
    profile: Profile
    base_url: str
    token: str | None
    mode: str = QUICK
    project_dir: Path = field(default_factory=Path.cwd)
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    request_log: Path | None = None  # the server's JSON-lines request log, when readable here
    # learned from the server by the endpoint check
    reachable: bool = False
    model_id: str | None = None
    context_window: int | None = None
    max_output_tokens: int | None = None
    health: dict[str, Any] = field(default_factory=dict)
    _client: EndpointClient | None = None

    @property
    def client(self) -> EndpointClient:
        if self._client is None:
            self._client = EndpointClient(self.base_url, self.token)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    @property
    def ttft_bound_s(self) -> float:
        return float(self.profile.admission.get("ttft_bound_s", 15.0))
