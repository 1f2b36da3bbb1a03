"""`ikcode plan`: conversations per cache tier and sessions active at once, for a profile."""

from __future__ import annotations

import json

import click


@click.command("plan")
@click.option(
    "--profile",
    "-p",
    "profile_name",
    default="deepinfer-4xb200",
    show_default=True,
    help="Profile name or TOML path.",
)
@click.option(
    "--context",
    "context_tokens",
    type=click.IntRange(min=1),
    default=450_000,
    show_default=True,
    help="Tokens per conversation.",
)
@click.option(
    "--agents", type=click.IntRange(min=1), default=100, show_default=True, help="Agents working at once."
)
@click.option(
    "--simulate",
    "check",
    is_flag=True,
    help="Also run the simulator at each limit, 10% under and 25% past it "
    "(fifo: every session resident; ikcode: turns in flight).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan_command(profile_name: str, context_tokens: int, agents: int, check: bool, as_json: bool) -> None:
    """Whether AGENTS agents of CONTEXT tokens fit the GPUs, by how much, and the most that do.

    Example: ikcode plan --profile deepinfer-4xb200 --context 500000 --agents 200
    """
    from rich.console import Console

    from ikcode.bench.hardware import HardwareModel, adapter_schedule
    from ikcode.plan import plan
    from ikcode.profiles import ProfileError, load_profile

    try:
        profile = load_profile(profile_name)
        if not profile.hardware:
            raise click.ClickException(f"profile {profile.name!r} has no [hardware] table to plan with")
        if context_tokens > profile.context_window:
            raise click.ClickException(
                f"--context {context_tokens:,} is past the profile's {profile.context_window:,}-token window"
            )
        hw = HardwareModel.from_dict(profile.hardware, name=profile.name)
        schedule = adapter_schedule(profile)
        result = plan(hw, context_tokens, agents, engine_schedule=schedule)
        if check:
            from ikcode.admission import AdmissionConfig
            from ikcode.plan import simulate_limit

            block = int(profile.cache.get("simulate_block_size", 2048))
            # Each policy at its own limit: every session resident (fifo), turns in flight (ikcode).
            fifo = AdmissionConfig.from_dict(profile.admission, policy="fifo")
            ikcode = AdmissionConfig.from_dict(profile.admission, policy="ikcode")
            result["simulated"] = simulate_limit(
                hw, context_tokens, result["max_agents_resident"], fifo, block
            )
            limit = result["max_agents_at_this_size"]
            result["simulated"] += simulate_limit(hw, context_tokens, limit, ikcode, block, schedule)
    except (ProfileError, ValueError) as err:
        raise click.ClickException(str(err)) from None
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    console = Console()
    gb = 1e9
    console.print(f"[bold]{hw.name}[/bold]: {context_tokens:,}-token conversations, {agents} agents")
    console.print(
        f"  mean conversation           {result['mean_conversation_tokens']:,} tokens "
        f"({result['conversation_bytes'] / gb:.2f} GB at {result['kv_bytes_per_token']:,} B/token)"
    )
    console.print(
        f"  KV per card                 {result['kv_tokens_per_card'] / 1e6:.2f}M tokens, "
        f"{result['usable_kv_tokens_per_card'] / 1e6:.2f}M under the {hw.prefill_watermark:.0%} watermark"
    )
    console.print(
        f"  every session resident      at most {result['max_agents_resident']} agents "
        f"(the GPU tier alone, {result['gpu_tier_tokens'] / 1e6:.0f}M tokens)"
    )
    console.print(
        f"  turns in flight             {result['turn_slots']} fit (each holds its conversation once); "
        f"an agent has one in flight {result['agent_busy_share']:.0%} of the time"
    )
    console.print(
        f"  limits                      {result['max_agents_memory']} agents by GPU memory, "
        f"{result['max_agents_compute']} by compute ({result['read_tokens_per_turn']:,} tokens read per turn "
        f"at {result['no_cache_read_tokens_per_s'] / 1e3:,.0f}K tokens/s)"
    )
    console.print(f"  most agents at this size    {result['max_agents_at_this_size']} ({result['limit']})")
    console.print(
        f"  cold read / host reload     {result['cold_read_s']:.2f} s / {result['reload_s']:.3f} s (one card)"
    )
    console.print(f"  {result['status']}")
    for row in result.get("simulated", []):
        console.print(
            f"  simulated ({row['policy']}) {row['agents']:>4} agents: median {row['p50']:.1f} s, "
            f"p95 {row['p95']:.1f} s, {row['cached_token_share']:.0%} from cache, {row['failed']} failed"
            + (f", {row['sessions_waited']} sessions waited for a slot" if row.get("sessions_waited") else "")
        )
    console.print(f"[bold]verdict:[/bold] {result['verdict']}")
