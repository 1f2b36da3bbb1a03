"""`ikcode bench`: synthetic coding agents, live against an endpoint or simulated on a profile."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from ikcode.cli.common import FiniteFloat


@click.command("bench")
@click.option(
    "--simulate", is_flag=True, help="Run against the profile's simulated hardware, not a live endpoint."
)
@click.option("--profile", "-p", "profile_name", default=None, help="Profile name or TOML path.")
@click.option(
    "--agents", type=click.IntRange(min=1), default=None, help="Agents (default: 100 simulated, 4 live)."
)
@click.option(
    "--context",
    "context_tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Tokens of a conversation's first turn (default: 450000 simulated, 2000 live).",
)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    type=click.Choice(["fifo", "ikcode", "lru"]),
    help="Admission policy fifo|ikcode (simulated; repeat to compare side by side), "
    "or cache policy lru|ikcode with --trace.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--duration",
    "duration_s",
    type=FiniteFloat(min=0, min_open=True),
    default=None,
    help="No new turns after this many seconds.",
)
@click.option(
    "--ramp",
    "ramp_s",
    type=FiniteFloat(min=0),
    default=None,
    help="Agents start at random over this many seconds.",
)
@click.option(
    "--tokens-per-step", type=click.IntRange(min=1), default=None, help="Median tokens appended per step."
)
@click.option(
    "--output-tokens", type=click.IntRange(min=1), default=None, help="Median output tokens per turn."
)
@click.option(
    "--tool-pause", "tool_pause_s", type=FiniteFloat(min=0), default=None, help="Median tool pause (s)."
)
@click.option(
    "--steps-per-conversation",
    type=click.IntRange(min=1),
    default=None,
    help="Turns before a fresh conversation.",
)
@click.option(
    "--max-cold-prefills", type=click.IntRange(min=1), default=None, help="Admission knob override."
)
@click.option(
    "--ttft-bound",
    "ttft_bound_s",
    type=FiniteFloat(min=0, min_open=True),
    default=None,
    help="Admission knob override (s).",
)
@click.option(
    "--aging", "aging_s", type=FiniteFloat(min=0), default=None, help="Admission knob override (s)."
)
@click.option("--no-shed", is_flag=True, help="Never shed cold work (admission knob).")
@click.option("--base-url", default=None, help="Live endpoint root (default: the profile's).")
@click.option("--token", default=None, help="Bearer token / API key for the live endpoint.")
@click.option("--model", default=None, help="Model name sent to the live endpoint (default: the served one).")
@click.option(
    "--device-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Device-tier capacity for --trace (tokens).",
)
@click.option(
    "--host-tokens", type=click.IntRange(min=0), default=None, help="Host-tier capacity for --trace (tokens)."
)
@click.option(
    "--trace",
    "trace_path",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="Replay a Mooncake-format trace through the profile's cache tiers instead.",
)
@click.option(
    "--sensitivity",
    is_flag=True,
    help="With --simulate: the sensitivity table (ramp, run length, each hardware figure +-20%).",
)
@click.option(
    "--json", "json_path", default=None, type=click.Path(dir_okay=False), help="Write the JSON report."
)
@click.option(
    "--chart", "chart_path", default=None, type=click.Path(dir_okay=False), help="Write a PNG chart."
)
def bench_command(**opts: Any) -> None:
    """Synthetic coding agents: TTFT p50/p95/p99 warm vs cold, failures, cache share, read rate."""
    from rich.console import Console

    from ikcode.admission import AdmissionConfig
    from ikcode.bench.chart import write_chart
    from ikcode.bench.hardware import HardwareModel, adapter_schedule
    from ikcode.bench.report import print_reports, write_json
    from ikcode.bench.workload import AgentsWorkload
    from ikcode.profiles import ProfileError, load_profile

    console = Console(stderr=True)
    simulate = opts["simulate"]
    try:
        profile = load_profile(
            opts["profile_name"] or ("deepinfer-4xb200" if simulate or opts["trace_path"] else None)
        )
    except ProfileError as err:
        raise click.ClickException(str(err)) from None
    _check_outputs(opts["json_path"], opts["chart_path"])  # before a run that may take minutes

    if opts["chart_path"] and (opts["trace_path"] or opts["sensitivity"]):
        raise click.UsageError("--chart draws a run's TTFT: not with --trace or --sensitivity (use --json)")
    if opts["trace_path"]:
        policies = opts["policies"] or (str(profile.cache.get("policy", "lru")),)
        if "fifo" in policies:
            raise click.UsageError("--trace replays the cache: --policy must be lru or ikcode")
        _replay(
            profile,
            opts["trace_path"],
            opts["json_path"],
            policies,
            opts["device_tokens"],
            opts["host_tokens"],
        )
        return
    if opts["sensitivity"] and not simulate:
        raise click.UsageError("--sensitivity needs --simulate")
    if "lru" in opts["policies"]:
        raise click.UsageError("--policy lru is a cache policy (use it with --trace); admission: fifo|ikcode")

    live_defaults = {
        "agents": 4,
        "context_tokens": 2000,
        "tokens_per_step": 200,
        "output_tokens": 16,
        "tool_pause_s": 0.5,
        "duration_s": 120.0,
        "ramp_s": 5.0,
        "steps_per_conversation": 8,
    }
    fields: dict[str, Any] = {} if simulate else dict(live_defaults)
    for key in (
        "agents",
        "context_tokens",
        "tokens_per_step",
        "output_tokens",
        "tool_pause_s",
        "duration_s",
        "ramp_s",
        "steps_per_conversation",
    ):
        if opts[key] is not None:
            fields[key] = opts[key]
    if not simulate and opts["ramp_s"] is None:  # a short run still starts every agent in it
        fields["ramp_s"] = min(fields["ramp_s"], fields["duration_s"] / 2)
    workload = AgentsWorkload(seed=opts["seed"], **fields)

    def progress(t: float, done: int) -> None:
        console.print(f"[dim]  t={t:7.0f} s  turns done {done}[/dim]")

    reports: list[dict[str, Any]] = []
    if simulate:
        from ikcode.bench.simulate import run_simulation

        if not profile.hardware:
            raise click.ClickException(f"profile {profile.name!r} has no [hardware] table to simulate")
        try:
            hw = HardwareModel.from_dict(profile.hardware, name=profile.name)
            schedule = adapter_schedule(profile)
            block = int(profile.cache.get("simulate_block_size", 2048))
            cache_policy = str(profile.cache.get("policy", "lru"))
            admissions = [
                AdmissionConfig.from_dict(
                    profile.admission,
                    policy=policy,
                    max_cold_prefills=opts["max_cold_prefills"],
                    ttft_bound_s=opts["ttft_bound_s"],
                    aging_s=opts["aging_s"],
                    shed=False if opts["no_shed"] else None,
                )
                for policy in opts["policies"] or ("fifo", "ikcode")
            ]
            if opts["sensitivity"]:
                _sensitivity(
                    hw, admissions, workload, block, cache_policy, schedule, opts["json_path"], console
                )
                return
            for admission in admissions:
                policy = admission.policy
                console.print(
                    f"simulating {workload.agents} agents x {workload.context_tokens:,} tokens, "
                    f"policy {policy}, {workload.duration_s:.0f} s ..."
                )
                reports.append(
                    run_simulation(hw, admission, workload, block, cache_policy, progress, schedule)
                )
        except ValueError as err:
            raise click.ClickException(str(err)) from None
    else:
        from ikcode.bench.live import run_live
        from ikcode.cli.serve import running_endpoint

        base_url = opts["base_url"] or running_endpoint(profile, named=opts["profile_name"] is not None)
        token = opts["token"] or _profile_token(profile, base_url)
        console.print(
            f"live: {workload.agents} agents x {workload.context_tokens:,} tokens against {base_url} ..."
        )
        model = opts["model"] or profile.served_model
        report = run_live(base_url, token, workload, model, progress=progress)
        report["config"]["policy"] = "live"
        reports.append(report)

    print_reports(reports, Console())
    if opts["json_path"]:
        write_json(reports, opts["json_path"])
    if opts["chart_path"]:
        title = f"{workload.agents} agents x {workload.context_tokens // 1000}K tokens ({profile.name})"
        write_chart(reports, opts["chart_path"], title)
    if any(r["failed"] for r in reports):
        sys.exit(1)


def _check_outputs(json_path: str | None, chart_path: str | None) -> None:
    """Refuse output paths that cannot be written before the run, not after it."""
    if chart_path and not chart_path.lower().endswith(".png"):
        raise click.BadParameter(f"{chart_path}: the chart is a PNG (name it *.png)", param_hint="--chart")
    for option, path in (("--json", json_path), ("--chart", chart_path)):
        if not path:
            continue
        folder = Path(path).resolve().parent
        if not folder.is_dir():
            raise click.BadParameter(f"{path}: no folder {folder}", param_hint=option)
        if not os.access(folder, os.W_OK):
            raise click.BadParameter(f"{path}: {folder} is not writable", param_hint=option)


def _sensitivity(
    hw: Any,
    admissions: list[Any],
    workload: Any,
    block: int,
    cache_policy: str,
    schedule: dict[str, int],
    json_path: str | None,
    console: Any,
) -> None:
    from ikcode.bench.sensitivity import format_rows, sensitivity_rows

    rows = sensitivity_rows(
        hw,
        admissions,
        workload,
        block,
        cache_policy,
        engine_schedule=schedule,
        progress=lambda label: console.print(f"[dim]  {label}[/dim]"),
    )
    click.echo(format_rows(rows))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump({"workload": workload.to_dict(), "hardware": hw.name, "rows": rows}, f, indent=2)
            f.write("\n")


def _profile_token(profile: Any, base_url: str) -> str | None:
    """What the live bench signs in with, as `ikcode claude` and `doctor` do (auth.client_token):
    IKCODE_TOKEN, else this machine's token, and that only to a server on this machine (it grants
    everything here); a profile's own `token_file` is this machine's server's token too."""
    import os
    from pathlib import Path
    from urllib.parse import urlsplit

    from ikcode import auth

    if os.environ.get("IKCODE_TOKEN") or not profile.auth.token_file:
        return auth.client_token(base_url)
    if not auth.is_loopback(urlsplit(base_url).hostname or ""):
        return None
    try:
        return Path(profile.auth.token_file).expanduser().read_text(encoding="utf-8").strip() or None
    except OSError:  # no token yet: the endpoint may not need one
        return None


def _replay(
    profile: Any,
    path: str,
    json_path: str | None,
    policies: tuple[str, ...],
    device_tokens: int | None,
    host_tokens: int | None,
) -> None:
    from ikcode.cache.trace_replay import format_table, replay_trace

    hw = profile.hardware
    results = [
        replay_trace(
            path,
            device_tokens=device_tokens or int(hw.get("device_tier_tokens", 57_000_000)),
            host_tokens=host_tokens if host_tokens is not None else int(hw.get("host_tier_tokens", 0)),
            policy=policy,
        )
        for policy in policies
    ]
    click.echo(format_table(results))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(results[0] if len(results) == 1 else {"runs": results}, f, indent=2, default=str)
