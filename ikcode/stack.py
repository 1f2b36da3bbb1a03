"""Assemble the serving stack from a profile: engine -> admission -> gateway app -> uvicorn.

This is the only place that knows which engine a profile names; the gateway sees an Engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ikcode import auth, daemon, server_log
from ikcode.cache.policy import make_policy
from ikcode.engines.base import Engine
from ikcode.model.errors import ModelLoadError
from ikcode.profiles import Profile

log = logging.getLogger("ikcode.stack")

MB = 1024 * 1024
DEFAULT_DRAIN_S = 30.0  # when `ikcode down` did not say (a plain SIGTERM or Ctrl-C)
# Requests one token may run at once on a server others reach, unless [auth] says: a Claude Code
# session with a few subagents in parallel stays under it; one client cannot fill the queue.
EXPOSED_REQUESTS_PER_USER = 16


@dataclass
class Stack:
    engine: Engine  # what the gateway talks to (admission wrapped around the engine)
    tokenizer: Any
    context_window: int
    description: str


def _embedded_engine(profile: Profile, model_path: str | None) -> tuple[Engine, Any, str]:
    from ikcode.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from ikcode.engines.embedded.threads import hand_threads_to_engine
    from ikcode.model.loader import load_model

    # Before loading: a parallel kernel run on this thread would give it an OpenMP team that
    # outlives the load and slows every kernel of the engine thread (threads.py).
    hand_threads_to_engine(profile.model.threads)
    source = model_path or profile.model.path or None
    log.info("loading model %s", source or "(default: SmolLM2-135M-Instruct)")
    loaded = load_model(source)
    how = "from the weight cache" if loaded.from_cache else "dequantized; cached for the next start"
    log.info("model loaded in %.1f s (%s)", loaded.load_seconds, how)
    host_mb = int(profile.cache.get("host_cache_mb", 0))
    engine = EmbeddedEngine(
        loaded.config,
        loaded.state_dict,
        EmbeddedEngineConfig(
            kv_memory_bytes=profile.model.kv_cache_mb * MB,
            host_kv_memory_bytes=host_mb * MB,
            max_num_seqs=profile.model.max_num_seqs,
            num_threads=profile.model.threads,
            device=profile.model.device,
            weights=profile.model.weights,
            float_weights=profile.model.float_weights,
            fp32_gemm=profile.model.fp32_gemm,
            batch_invariance=profile.model.batch_invariance,
            model_name=profile.served_model,
            cache_policy=str(profile.cache.get("policy", "lru")),
        ),
    )
    runner = engine.runner
    what = (
        f"embedded engine on {engine.info.device}, {loaded.config.name} from {loaded.source} "
        f"(weights {runner.float_weights}; sampled decode rows {runner.decode_weights})"
    )
    return engine, loaded.tokenizer, what


def _deepinfer_engine(profile: Profile, model_path: str | None) -> tuple[Engine, Any, str]:
    from ikcode.engines.deepinfer.launch import deepinfer_stack_parts
    from ikcode.engines.deepinfer.machine import MachineCheckError

    try:
        return deepinfer_stack_parts(profile, model_path)
    except (MachineCheckError, ValueError) as err:
        raise daemon.DaemonError(f"cannot start DeepInfer on this machine: {err}") from None


def build_stack(profile: Profile, model_path: str | None = None) -> Stack:
    from ikcode.admission import AdmissionConfig, AdmissionController

    if profile.engine not in ("embedded", "deepinfer"):
        raise daemon.DaemonError(
            f"profile {profile.name!r} uses engine {profile.engine!r}, which `ikcode up` cannot start "
            "in this version; use the `local` profile (embedded engine)"
        )
    try:  # before loading anything: a bad knob must not leave an engine running
        admission = AdmissionConfig.from_dict(profile.admission)
        check_cache_table(profile.cache)
    except (TypeError, ValueError) as err:
        raise daemon.DaemonError(f"profile {profile.source}: {err}") from None
    session_limit = _session_limit(profile)
    try:
        if profile.engine == "deepinfer":
            engine, tokenizer, description = _deepinfer_engine(profile, model_path)
        else:
            engine, tokenizer, description = _embedded_engine(profile, model_path)
    except ModelLoadError as err:
        raise daemon.DaemonError(str(err)) from None
    controller = AdmissionController(engine, admission, session_limit=session_limit)
    controller.start()
    window = min(profile.context_window, engine.info.context_window)
    return Stack(controller, tokenizer, window, description)


def check_cache_table(cache: dict[str, Any]) -> None:
    """The [cache] values the serving stack reads, checked before the model loads (a policy name
    or a size of the wrong kind used to fail only after it)."""
    make_policy(str(cache.get("policy", "lru")))  # ValueError naming the known ones
    host_mb = cache.get("host_cache_mb", 0)
    if isinstance(host_mb, bool) or not isinstance(host_mb, int) or host_mb < 0:
        raise ValueError(f"[cache] host_cache_mb must be a whole number of MB >= 0, got {host_mb!r}")
    snapshot_mb = cache.get("snapshot_cache_mb", 1)  # DeepInfer's window snapshots (0: nothing resumes)
    if isinstance(snapshot_mb, bool) or not isinstance(snapshot_mb, int) or snapshot_mb < 1:
        raise ValueError(f"[cache] snapshot_cache_mb must be a whole number of MB >= 1, got {snapshot_mb!r}")


def _session_limit(profile: Profile) -> Callable[[int], int] | None:
    """The most sessions at once `ikcode plan` gives the profile's [hardware] figures (admission
    applies it when its max_active_sessions is "plan"); None without figures."""
    if not profile.hardware:
        return None
    from ikcode.bench.hardware import HardwareModel, adapter_schedule
    from ikcode.plan import session_limit

    try:
        hw = HardwareModel.from_dict(profile.hardware, name=profile.name)
    except (TypeError, ValueError) as err:
        raise daemon.DaemonError(f"profile {profile.source}: {err}") from None
    return session_limit(hw, adapter_schedule(profile))


def cache_salting(profile: Profile) -> bool | None:
    """`[cache] salt_per_user`: false shares one cache among all users (a single-team server that
    wants the hits); true or absent isolates each token's entries whenever several can connect."""
    value = profile.cache.get("salt_per_user")
    if value is None or isinstance(value, bool):
        return value
    raise daemon.DaemonError(
        f"profile {profile.source}: cache.salt_per_user must be true or false, got {value!r}"
    )


def gateway_settings(profile: Profile, host: str, context_window: int):
    from ikcode.gateway.settings import GatewaySettings

    tokens: dict[str, str] = {}
    if profile.auth.required or not auth.is_loopback(host):
        tokens = {auth.OWNER: auth.load_or_create_token(), **auth.team_tokens()}
    per_user = profile.auth.max_requests_per_user
    if per_user is None and not auth.is_loopback(host):
        per_user = EXPOSED_REQUESTS_PER_USER
    return GatewaySettings(
        max_requests_per_user=per_user,
        cache_salt_per_user=cache_salting(profile),
        served_model=profile.served_model,
        context_window=context_window,
        max_output_tokens=profile.max_output_tokens,
        auth_tokens=tokens,
        bind_loopback=auth.is_loopback(host),
        request_log_path=daemon.request_log_file(),
        default_temperature=profile.model.default_temperature,
        repeat_penalty=profile.model.repeat_penalty,
        repeat_last_n=profile.model.repeat_last_n,
        frequency_penalty=profile.model.frequency_penalty,
        presence_penalty=profile.model.presence_penalty,
        summary_max_tokens=profile.compaction.summary_max_tokens or None,
        tool_format=profile.model.tool_format,
    )


def _claim_server(profile: Profile, host: str, port: int, url: str) -> None:
    """Refuse to start beside a running server or on a taken port; else write this one's state."""
    running = daemon.read_state()
    if running is not None and running.pid != os.getpid():
        raise daemon.DaemonError(f"ikcode is already running (pid {running.pid}) at {running.url}")
    problem = daemon.bind_problem(host, port)
    if problem is not None:
        raise daemon.DaemonError(problem)
    pid = os.getpid()
    state = daemon.ServerState(
        pid, host, port, url, profile.name, str(daemon.log_file()), time.time(), daemon.process_identity(pid)
    )
    daemon.write_state(state)


def serve_foreground(profile: Profile, port: int, model_path: str | None = None) -> None:
    """Run the stack in this process until SIGTERM/SIGINT (what `ikcode up` runs in the background)."""
    from ikcode.gateway import create_app
    from ikcode.gateway.server import run_server

    server_log.configure()
    host = profile.endpoint.host
    try:  # what the gateway will need, checked before minutes of model loading, not after
        gateway_settings(profile, host, profile.context_window)
    except ValueError as err:
        raise daemon.DaemonError(str(err)) from None
    url = profile.model_copy(update={"endpoint": profile.endpoint.model_copy(update={"port": port})}).base_url
    # Spawned by `ikcode up` or a launcher: it holds the start lock until this server answers
    # (the environment says so; its state file may not be written yet). Run by hand: take the lock
    # for the check and the claim, so that two started at once do not both pass the check and
    # load a model for one port.
    spawned = os.environ.pop(daemon.SPAWNED_ENV, None) is not None
    with contextlib.nullcontext() if spawned else daemon.start_lock():
        _claim_server(profile, host, port, url)
    daemon.drain_file().unlink(missing_ok=True)  # a timeout left by an earlier `ikcode down`
    # SIGTERM while the model loads: leave at once (uvicorn installs its own handler later).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        if profile.engine == "upstream":  # an existing server: connect to it, start nothing
            from ikcode.upstream.profile import upstream_app

            try:
                app, what = upstream_app(profile, gateway_settings(profile, host, profile.context_window))
            except ValueError as err:
                raise daemon.DaemonError(str(err)) from None
            log.info("%s; serving %s at %s", what, profile.served_model, url)
            drain_s = lambda: daemon.read_drain_timeout(DEFAULT_DRAIN_S)  # noqa: E731
            run_server(app, host, port, log_level="warning", drain_timeout_s=drain_s)
            return
        stack = build_stack(profile, model_path)
        log.info("%s", stack.description)
        settings = gateway_settings(profile, host, stack.context_window)
        app = create_app(stack.engine, stack.tokenizer, settings)
        log.info("serving %s at %s (context window %d)", profile.served_model, url, stack.context_window)
        try:
            run_server(
                app,
                host,
                port,
                log_level="warning",
                drain_timeout_s=lambda: daemon.read_drain_timeout(DEFAULT_DRAIN_S),
            )
        finally:
            log.info("stopping the engine")
            # The gateway drained and cut every request already: what is left is bookkeeping.
            stack.engine.shutdown(drain_timeout_s=5)
            log.info("stopped")
    finally:
        daemon.clear_state(os.getpid())
