"""POST /v1/messages and /v1/messages/count_tokens: validate, render, submit, answer."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from ikcode.auth import user_session
from ikcode.engines.base import (
    CacheLookup,
    EngineError,
    EngineRequest,
    PromptBlockHashes,
    PromptTooLong,
    RequestStream,
    SamplingParams,
)
from ikcode.gateway.compaction import is_summary_request
from ikcode.gateway.drain import check_draining
from ikcode.gateway.edge import check_concurrency, check_max_tokens, check_model, clip, clip_session
from ikcode.gateway.errors import APIError, from_engine_error, invalid_request
from ikcode.gateway.generation import Generation, release_slot, take_slot
from ikcode.gateway.prompt_chain import RenderedPrompt
from ikcode.gateway.request_limits import check_prompt_chars
from ikcode.gateway.request_log import now_iso
from ikcode.gateway.schemas import CountTokensRequest, MessagesRequest
from ikcode.gateway.sse import STREAM_HEADERS, ClosingStreamingResponse
from ikcode.gateway.state import Gateway


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


# Below this a temperature or top_p is not a distribution the engine can sample: logits divided
# by 1e-38 overflow float32, and a top_p under float32's smallest normal rounds to 0 (every token
# dropped). Either gives NaN probabilities; 0 (greedy) is what such a client means.
MIN_SAMPLING_VALUE = 1e-5


def check_sampling_value(name: str, value: float | None) -> None:
    if value is not None and 0.0 < value < MIN_SAMPLING_VALUE:
        raise invalid_request(f"{name}: must be 0 or at least {MIN_SAMPLING_VALUE:g}, got {value!r}")


def sampling_params(gw: Gateway, body: MessagesRequest) -> SamplingParams:
    check_sampling_value("temperature", body.temperature)
    check_sampling_value("top_p", body.top_p)
    check_max_tokens(gw, body.max_tokens)
    temperature = gw.settings.default_temperature if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    if top_p == 0.0:  # nucleus of zero mass: only the most likely token
        temperature, top_p = 0.0, 1.0
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=body.top_k or 0,
        max_tokens=body.max_tokens,
        stop_token_ids=gw.renderer.stop_token_ids,
        repeat_penalty=gw.settings.repeat_penalty,
        repeat_last_n=gw.settings.repeat_last_n,
        frequency_penalty=gw.settings.frequency_penalty,
        presence_penalty=gw.settings.presence_penalty,
    )


# The reply builder looks for each stop sequence in every piece of text it streams, on the event
# loop: 60,000 of them made each token cost 23 ms. A client needs a handful.
MAX_STOP_SEQUENCES = 64


def check_unsupported(body: MessagesRequest) -> None:
    output_format = (body.output_config or {}).get("format")
    if output_format is not None:
        raise invalid_request(
            "output_config.format: structured output (JSON schema constrained decoding) is not "
            "supported by this server's engine; ask for JSON in the prompt instead"
        )
    check_tool_choice(body)
    stops = body.stop_sequences or []
    if len(stops) > MAX_STOP_SEQUENCES:  # each is looked for in every piece of text streamed
        raise invalid_request(f"stop_sequences: at most {MAX_STOP_SEQUENCES} are accepted, got {len(stops)}")
    for index, stop in enumerate(stops):
        if not stop.strip():
            raise invalid_request(f"stop_sequences.{index}: each stop sequence must contain non-whitespace")


def check_tool_choice(body: MessagesRequest | CountTokensRequest) -> None:
    """400 for a tool_choice no answer could meet: a call to a tool the request does not list,
    or any call with no tools at all."""
    choice = body.tool_choice
    if choice is None or choice.type not in ("any", "tool"):
        return
    names = {tool.name for tool in body.tools or ()}
    if choice.type == "tool" and not choice.name:
        raise invalid_request("tool_choice.name: required when tool_choice.type is 'tool'")
    if not names:
        raise invalid_request(f"tool_choice.type: '{choice.type}' needs at least one tool in `tools`")
    if choice.type == "tool" and choice.name not in names:
        raise invalid_request(f"tool_choice.name: {clip(choice.name)} is not one of the request's tools")


def _render(
    gw: Gateway,
    body: MessagesRequest | CountTokensRequest,
    salt: str,
    conversation: tuple[str, str] | None = None,
    body_bytes: int = 0,
) -> RenderedPrompt:
    return gw.renderer.render(
        body.system, body.tools, body.tool_choice, body.messages, conversation, salt, body_bytes
    )


def user_salt(gw: Gateway, user: str | None) -> str:
    """The user's cache namespace ("" when the server shares one cache among its users)."""
    return (user or "") if gw.settings.salts_per_user else ""


def _log_shared_prefix(
    gw: Gateway,
    body: MessagesRequest,
    session_id: str | None,
    rendered: RenderedPrompt,
    record: dict[str, Any],
) -> None:
    """How much of this prompt repeats the session's previous one (for the silent-miss check)."""
    copied = (rendered.reused_from, rendered.reused_tokens) if rendered.reused_from is not None else None
    shared = gw.sessions.observe(
        session_id, rendered.token_ids, [end for _, end in rendered.boundaries], copied
    )
    if shared is None:
        return
    record["prefix_shared_tokens"] = shared.shared_tokens
    record["previous_prompt_tokens"] = shared.previous_tokens
    if shared.segment is not None:
        in_system = shared.segment == 0 and bool(body.system or body.tools)
        record["prefix_break"] = "system" if in_system else "messages"


def _render_and_lookup(
    gw: Gateway,
    body: MessagesRequest,
    salt: str,
    session_id: str | None = None,
    record: dict[str, Any] | None = None,
    body_bytes: int = 0,
) -> tuple[RenderedPrompt, CacheLookup, PromptBlockHashes | None]:
    """Render, hash (incrementally: only the blocks the conversation's previous turn did not
    have) and look the prompt up in the cache. The hashes travel with the request to the
    admission layer and the engine, so nothing hashes the prompt again."""
    # The conversation's previous render is reused per user (salt) and session: requests without
    # a session id share one such key per user.
    rendered = _render(gw, body, salt, (salt, session_id or ""), body_bytes)
    if record is not None:
        record["render_reused_tokens"] = rendered.reused_tokens
        _log_shared_prefix(gw, body, session_id, rendered, record)
    n = len(rendered.token_ids)
    if n >= gw.context_window:
        return rendered, CacheLookup(n), None
    hashes = PromptBlockHashes(gw.block_hasher.block_size, salt, gw.block_hasher.hashes(rendered, salt))
    if n > gw.settings.predict_usage_max_tokens:
        return rendered, CacheLookup(n), hashes
    return rendered, gw.engine.lookup(rendered.token_ids, salt, hashes), hashes


async def submit_off_loop(engine: Any, engine_request: EngineRequest) -> RequestStream:
    """engine.submit on a worker thread: an engine may ask its workers first (a DeepInfer rank
    answers between steps, and a prefill chunk is seconds of one card), and the event loop must
    keep serving every other stream meanwhile. A handler cancelled while it waits (the client
    left) aborts the request the engine then took: nothing runs for nobody."""
    task = asyncio.ensure_future(run_in_threadpool(engine.submit, engine_request))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_abort_if_submitted)
        raise


def _abort_if_submitted(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().abort()


async def _prepare_and_submit(
    gw: Gateway,
    request: Request,
    body: MessagesRequest,
    sampling: SamplingParams,
    user: str | None,
    session_key: str | None,
    request_id: str,
    record: dict[str, Any],
) -> tuple[RequestStream, RenderedPrompt, CacheLookup, float]:
    """Tokenize the prompt, bound the reply by the window, hand it to the engine: (its stream,
    the render, the cache lookup, when it was submitted). Called holding the request's slot."""
    salt = user_salt(gw, user)
    rendered, lookup, block_hashes = await run_in_threadpool(
        _render_and_lookup, gw, body, salt, session_key, record, getattr(request.state, "body_bytes", 0)
    )
    summary = is_summary_request(body)
    if summary:  # a compaction: a cold read of the whole conversation and a long summary
        record["compaction"] = True  # logged as such, refused or not
    prompt_tokens = len(rendered.token_ids)
    if prompt_tokens >= gw.context_window:
        raise invalid_request(str(PromptTooLong(prompt_tokens, gw.context_window - 1)))
    # The reply cannot run past the context window.
    room = gw.context_window - prompt_tokens
    if summary:
        # Its output capped by the server (summary_max_tokens) or by the window: either way
        # the summary is final. Claude Code keeps what it gets with "end_turn"; "max_tokens"
        # has it ask for more, re-reading the conversation each time, then fail the turn.
        cap = gw.settings.summary_max_tokens
        limit = min(room, cap if cap is not None else room)
        if sampling.max_tokens > limit:
            record["summary_max_tokens"] = limit
    if sampling.max_tokens > room and not summary:
        record["window_max_tokens"] = room  # the window, not max_tokens, bounds this reply
    sampling = replace(sampling, max_tokens=min(sampling.max_tokens, room))
    if "summary_max_tokens" in record:
        sampling = replace(sampling, max_tokens=record["summary_max_tokens"])
    # An agent step (a session with tools) usually comes back within seconds, after its tool
    # runs: ask the cache to keep that session's tail on the device for a bounded time.
    hold = gw.settings.session_hold_s if (session_key and body.tools) else None
    engine_request = EngineRequest(
        request_id,
        rendered.token_ids,
        sampling,
        salt,
        session_key,
        hold_tail_s=hold,
        block_hashes=block_hashes,
    )
    check_draining(gw)  # the drain may have begun while this prompt was rendered
    submitted = time.monotonic()
    try:
        stream = await submit_off_loop(gw.engine, engine_request)
    except EngineError as error:
        raise from_engine_error(error) from None
    return stream, rendered, lookup, submitted


async def create_message(gw: Gateway, request: Request, body: MessagesRequest, user: str | None) -> Response:
    arrived = time.monotonic()
    request_id = new_message_id()
    session_id = request.headers.get("x-claude-code-session-id")
    # Within the server a session is its user's own: another token sending the same id (a script's
    # fixed id, a copied header) neither reads this session's state nor rides its admission slot.
    session_key = user_session(user, session_id)
    record: dict[str, Any] = {
        "ts": now_iso(),
        "request_id": request_id,
        "session_id": clip_session(session_id),
        "user": user,
        "model": clip(body.model),
        "stream": bool(body.stream),
    }
    try:
        check_draining(gw)
        check_model(gw, body.model)
        sampling = sampling_params(gw, body)
        check_unsupported(body)
        check_concurrency(gw.settings, gw.in_flight, gw.in_flight_by_user, user)
        check_prompt_chars(body, gw.context_window, gw.max_token_chars)  # before tokenizing
        # The slot is taken before the prompt is tokenized: N requests of one token at once
        # tokenized N prompts before the cap turned all but one away. It passes to the
        # Generation with the stream, and is given back on any way out before that.
        take_slot(gw, user or "")
        try:
            stream, rendered, lookup, submitted = await _prepare_and_submit(
                gw, request, body, sampling, user, session_key, request_id, record
            )
        except BaseException:
            release_slot(gw, user or "")
            raise
    except APIError as error:
        record.update(status=error.status, error=error.message)
        gw.log.write(record)
        raise
    generation = Generation(
        gw,
        request_id,
        body.model,
        stream,
        rendered,
        lookup,
        body.stop_sequences or [],
        record,
        arrived,
        submitted,
    )
    if body.stream:
        return ClosingStreamingResponse(
            generation.sse(),
            on_close=generation.close,
            outcome=generation.outcome_status,
            media_type="text/event-stream",
            headers=STREAM_HEADERS,
        )
    return await generation.collect(request)


async def count_tokens(gw: Gateway, body: CountTokensRequest, user: str | None) -> Response:
    check_draining(gw)
    check_model(gw, body.model)
    check_tool_choice(body)
    check_concurrency(gw.settings, gw.in_flight, gw.in_flight_by_user, user)
    # A prompt that cannot fit the window is refused before it is tokenized, as in create_message.
    check_prompt_chars(body, gw.context_window, gw.max_token_chars)
    take_slot(gw, user or "")  # tokenizing is work of the token's, under the same caps
    try:
        rendered = await run_in_threadpool(_render, gw, body, user_salt(gw, user))
    finally:
        release_slot(gw, user or "")
    return JSONResponse({"input_tokens": len(rendered.token_ids)})
