"""When Claude Code compacts: the environment that makes it summarise before the served window.

Measured with bench/compaction_probe.py (a recorder reports a chosen conversation size; the next
turn either compacts, refuses with `blocking_limit`, or goes on), clients 2.1.197 and 2.1.332:

- CLAUDE_CODE_AUTO_COMPACT_WINDOW below 100,000 is read as 100,000 and the interactive client
  prints a warning at every start. On 2.1.332 it changes nothing measurable; on 2.1.197 it makes
  the client refuse the turn (`terminal_reason: blocking_limit`, exit 1) at
  window - max output - 3,000 tokens instead of compacting. So it is not set.
- CLAUDE_CODE_MAX_CONTEXT_TOKENS: 2.1.332 reads it only when DISABLE_COMPACT is set; otherwise its
  `contextWindow` (/context, the status line JSON) stays 1M. Set anyway, for the clients that read it.
- CLAUDE_CODE_BLOCKING_LIMIT_OVERRIDE: on 2.1.332 (with the window above) a conversation at or
  past this many tokens is compacted before the next request is sent; without it that happens at
  window - max output - 3,000 (51% of an 8K window, 97% of 128K). On 2.1.197 it has no effect
  (that client compacts only when the server answers "prompt is too long", which the gateway
  says in the wording the client looks for).
- CLAUDE_AUTOCOMPACT_PCT_OVERRIDE scales a threshold of window - max output - 13,000, which is
  below zero for windows under ~14K: not usable for small windows, not set.
"""

from __future__ import annotations

# A summary request is the whole conversation plus the client's summary instructions (~1,370
# tokens from 2.1.332 in SmolLM2's tokenizer) plus the summary itself (capped by the gateway).
# Compacting at 3/4 of an 8K window leaves room for both while the conversation has not grown
# past ~6,800 tokens since the client last checked; past that the client drops its oldest
# messages to summarise what fits.
DEFAULT_COMPACT_AT_FRACTION = 0.75


def compact_at_tokens(context_window: int, compact_at_fraction: float = DEFAULT_COMPACT_AT_FRACTION) -> int:
    if not 0.0 < compact_at_fraction <= 1.0:
        raise ValueError(f"compact_at_fraction must be in (0, 1], got {compact_at_fraction}")
    return max(1, int(context_window * compact_at_fraction))


def compaction_env(
    context_window: int, compact_at_fraction: float = DEFAULT_COMPACT_AT_FRACTION
) -> dict[str, str]:
    """The variables that make Claude Code compact at `compact_at_fraction` of the served window."""
    return {
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(context_window),
        "CLAUDE_CODE_BLOCKING_LIMIT_OVERRIDE": str(compact_at_tokens(context_window, compact_at_fraction)),
    }


# Set by older versions of the launcher (or by hand) and harmful here (see above): removed from
# the child's environment.
UNSET_VARS: tuple[str, ...] = ("CLAUDE_CODE_AUTO_COMPACT_WINDOW",)
