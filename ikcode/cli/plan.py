"""`ikcode plan`: conversations per cache tier and sessions active at once, for a profile."""

from __future__ import annotations

import json

import click


@click.command("plan")
@click.option(
    "--profile",
    "profile_name",
    default="deepinfer-4xb200",
    show_default=True,
    help="Profile name or TOML path.",
)
@click.option(
    "--context",
    "context_tokens",
    type=int,
    default=450_000,
    show_default=True,
    help="Tokens per conversation.",
)
@click.option("--agents", type=int, default=100, show_default=True, help="Agents working at once.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan_command(profile_name: str, context_tokens: int, agents: int, as_json: bool) -> None:
    """How many conversations each tier holds, and how many can be active at once."""
    from rich.console import Console

    from ikcode.engines.simulated import HardwareModel
    from ikcode.plan import plan
    from ikcode.profiles import ProfileError, load_profile

    try:
        profile = load_profile(profile_name)
        if not profile.hardware:
            raise click.ClickException(f"profile {profile.name!r} has no [hardware] table to plan with")
        hw = HardwareModel.from_dict(profile.hardware, name=profile.name)
        result = plan(hw, context_tokens, agents)
    except (ProfileError, ValueError) as err:
        raise click.ClickException(str(err)) from None
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    console = Console()
    gb = 1e9
    console.print(f"[bold]{hw.name}[/bold]: {context_tokens:,}-token conversations, {agents} agents")
    console.print(
        f"  KV bytes per token          {result['kv_bytes_per_token']:,} B "
        f"({result['conversation_bytes'] / gb:.2f} GB per conversation)"
    )
    console.print(
        f"  GPU tier                    {result['gpu_tier_tokens'] / 1e6:,.0f}M tokens "
        f"({result['gpu_tier_bytes'] / gb:,.0f} GB): {result['conversations_on_gpu']:,} conversations"
    )
    console.print(
        f"  host tier                   {result['host_tier_tokens'] / 1e6:,.0f}M tokens "
        f"({result['host_tier_bytes'] / gb:,.0f} GB): {result['conversations_in_host']:,} conversations"
    )
    console.print(
        f"  active at once (estimate)   ~{result['active_at_once']:.0f} of {agents} "
        f"(busy {result['agent_busy_share']:.0%} of a {result['agent_cycle_s']:.1f} s turn cycle)"
    )
    console.print(f"  most agents at this size    ~{result['max_agents_at_this_size']:,}")
    console.print(f"  cold read / host reload     {result['cold_read_s']:.2f} s / {result['reload_s']:.3f} s")
    console.print(f"  {result['status']}")
    console.print(f"[bold]verdict:[/bold] {result['verdict']}")
