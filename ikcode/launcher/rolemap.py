"""The role mapper: from a served model, the environment Claude Code needs.

Pure functions. Claude Code asks for a different model name per role (main loop, opus/sonnet/
haiku aliases, subagents, small/fast calls); an unmapped role silently sends `claude-*` names to the
endpoint. Every role is mapped to the one served model here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ikcode.auth import is_loopback
from ikcode.launcher.compaction import DEFAULT_COMPACT_AT_FRACTION, compaction_env
from ikcode.launcher.compaction import UNSET_VARS as COMPACTION_UNSET_VARS

# Every variable through which Claude Code picks a model name for some role.
MODEL_ROLE_VARS: tuple[str, ...] = (
    "ANTHROPIC_MODEL",
    "ANTHROPIC_DEFAULT_OPUS_MODEL",
    "ANTHROPIC_DEFAULT_SONNET_MODEL",
    "ANTHROPIC_DEFAULT_HAIKU_MODEL",
    "ANTHROPIC_DEFAULT_FABLE_MODEL",
    "CLAUDE_CODE_SUBAGENT_MODEL",
    "ANTHROPIC_SMALL_FAST_MODEL",  # deprecated, but still wins for small/fast calls
)

ENDPOINT_VARS: tuple[str, ...] = ("ANTHROPIC_BASE_URL", "ANTHROPIC_AUTH_TOKEN")

# Variables that would fight the mapping in the child process.
CONFLICTING_VARS: tuple[str, ...] = (
    "ANTHROPIC_API_KEY",  # sent as x-api-key beside our bearer token
    "CLAUDE_CODE_USE_BEDROCK",
    "CLAUDE_CODE_USE_VERTEX",
    "CLAUDE_CODE_USE_FOUNDRY",
    # Headers added to every request (a company proxy's credentials): they belong to the user's
    # own Anthropic traffic, not to this server or a teammate's it may point at.
    "ANTHROPIC_CUSTOM_HEADERS",
)

# Claude Code prints `[claude-code:unrecognized_model] {...}` on stderr for every model id it does
# not know. It stays quiet when a settings file's `modelOverrides` maps a Claude model id it knows
# to that id (2.1.332: the check returns early when `dSe(model)` holds, and `dSe` resolves the id
# through `Rt().modelOverrides`, keeping keys that name a known model). The key chosen is the
# client's own default main-loop model, whose request shape (adaptive thinking, effort, the
# mid-conversation betas) is the one it sends for an unknown model too; the window and output
# limits still come from the variables below.
DECLARED_AS_MODEL = "claude-opus-4-8"

FIXED_VARS: dict[str, str] = {
    # The attribution line in system[0] differs per conversation and defeats prefix caching.
    "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
}


@dataclass(frozen=True)
class Mapping:
    """What to set and what to remove in Claude Code's environment."""

    set: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()
    # Settings-file keys beside `env` (a settings file only; the client reads no variable for it).
    model_overrides: dict[str, str] = field(default_factory=dict)

    def apply(self, environ: dict[str, str]) -> dict[str, str]:
        """A copy of environ with the mapping applied (for launching the child)."""
        child = {k: v for k, v in environ.items() if k not in self.unset}
        child.update(self.set)
        return child

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.set) + self.unset


def claude_env(
    *,
    served_model: str,
    base_url: str,
    token: str | None,
    context_window: int,
    max_output_tokens: int,
    api_timeout_ms: int = 600_000,
    compact_at_fraction: float = DEFAULT_COMPACT_AT_FRACTION,
    no_proxy: str = "",
) -> Mapping:
    """The environment that maps every Claude Code role to `served_model` at `base_url`.
    no_proxy: the user's NO_PROXY, kept, with a loopback endpoint's host added (an HTTPS_PROXY
    in the shell would otherwise carry requests for this machine's server off to the proxy)."""
    if not served_model:
        raise ValueError("served model name is empty")
    values: dict[str, str] = {"ANTHROPIC_BASE_URL": base_url.rstrip("/")}
    host = urlsplit(base_url).hostname or ""
    if is_loopback(host):
        hosts = [h.strip() for h in no_proxy.split(",") if h.strip()]
        hosts += [h for h in (host, "localhost") if h not in hosts]
        values["NO_PROXY"] = values["no_proxy"] = ",".join(hosts)
    if token:
        values["ANTHROPIC_AUTH_TOKEN"] = token
    for name in MODEL_ROLE_VARS:
        values[name] = served_model
    values.update(FIXED_VARS)
    values["API_TIMEOUT_MS"] = str(api_timeout_ms)
    values["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max_output_tokens)
    # The client assumes a 200K or 1M window for unknown models: tell it the real one, and where
    # to compact (see launcher/compaction.py for what was measured).
    values.update(compaction_env(context_window, compact_at_fraction))
    unset = CONFLICTING_VARS if token else tuple(v for v in CONFLICTING_VARS if v != "ANTHROPIC_API_KEY")
    unset += COMPACTION_UNSET_VARS
    # The picker's label for the served model (the opus role is where the main loop points).
    values["ANTHROPIC_DEFAULT_OPUS_MODEL_NAME"] = served_model
    values["ANTHROPIC_DEFAULT_OPUS_MODEL_DESCRIPTION"] = f"{served_model} served by ikcode"
    return Mapping(set=values, unset=unset, model_overrides={DECLARED_AS_MODEL: served_model})
