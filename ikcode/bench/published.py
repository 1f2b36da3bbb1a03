"""The published 4x B200 figures, and each simulated prediction printed beside its figure."""

from __future__ import annotations

from typing import Any

# (agents, context tokens) -> what the published runs measured (fifo: no admission layer).
PUBLISHED: dict[tuple[int, int], dict[str, float]] = {
    (100, 450_000): {
        "p50": 2.55,
        "p95": 37.0,
        "cached_token_share": 0.96,
        "read_tokens_per_s": 1.8e6,
        "failed": 0,
    },
    (200, 500_000): {"p50_at_least": 120.0, "failed": 0},
}
NO_CACHE_READ_TOKENS_PER_S = 200_000.0


def comparisons(report: dict[str, Any]) -> list[str]:
    """Lines 'figure: simulated vs published (ratio)' for a fifo report of a published size."""
    w = report["config"].get("workload", {})
    lines = [
        f"no-cache read: {report.get('no_cache_read_tokens_per_s', 0):,.0f} tokens/s vs published "
        f"{NO_CACHE_READ_TOKENS_PER_S:,.0f} (calibrated: prefill_flops_per_s)"
    ]
    published = PUBLISHED.get((w.get("agents"), w.get("context_tokens")))
    if published is None or report["config"].get("policy") != "fifo":
        return lines
    sim = {
        "p50": report["ttft"]["p50"],
        "p95": report["ttft"]["p95"],
        "cached_token_share": report["cached_token_share"],
        "read_tokens_per_s": report["read_tokens_per_s"],
        "failed": report["failed"],
    }
    for key, value in published.items():
        if key == "p50_at_least":
            lines.append(f"median TTFT: {sim['p50']:.1f} s vs published > {value:.0f} s")
        elif key == "failed":
            lines.append(f"failed requests: {sim['failed']} vs published {value:.0f}")
        else:
            ratio = sim[key] / value if value else 0.0
            lines.append(f"{key}: {sim[key]:,.3g} vs published {value:,.3g} ({ratio:.2f}x)")
    return lines
