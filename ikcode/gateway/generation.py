"""One running answer: engine events in, SSE or a JSON message out, and the bookkeeping after.

Whatever happens (a finished reply, a stop sequence, an engine error, a client that hangs up)
the engine request ends (`engine.abort` when we stop reading early), the stream ends with a final
event, the request is logged and counted, and a finished reply's token ids are remembered for
the next turn of the conversation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ikcode.engines.base import (
    CacheLookup,
    EngineError,
    EngineShutdown,
    FinishReason,
    RequestStats,
    RequestStream,
    TokenEvent,
)
from ikcode.gateway.edge import CLIENT_CLOSED, client_disconnected
from ikcode.gateway.errors import APIError, from_engine_error
from ikcode.gateway.metrics import WARM_HIT_RATE
from ikcode.gateway.prompt_chain import RenderedPrompt
from ikcode.gateway.reply_builder import ReplyBuilder
from ikcode.gateway.sse import PING, sse_event
from ikcode.gateway.state import Gateway
from ikcode.gateway.tool_formats import TextOnlyParser

logger = logging.getLogger("ikcode.gateway")


class _EventReader:
    """Next engine event, or None after `timeout` (time to send a ping); cancellable."""

    def __init__(self, stream: RequestStream):
        self._iter = stream.__aiter__()
        self._pending: asyncio.Future[TokenEvent] | None = None

    async def next(self, timeout: float, interrupt: asyncio.Future | None = None) -> TokenEvent | None:
        """None also when `interrupt` completes first."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._iter.__anext__())
        waiting = {self._pending} if interrupt is None else {self._pending, interrupt}
        done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if self._pending not in done:
            return None
        task, self._pending = self._pending, None
        return task.result()

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None


class Generation:
    def __init__(
        self,
        gw: Gateway,
        request_id: str,
        model: str,
        stream: RequestStream,
        rendered: RenderedPrompt,
        lookup: CacheLookup,
        stop_sequences: list[str],
        record: dict[str, Any],
        arrived: float,
        submitted: float,
    ):
        self.gw = gw
        self.request_id = request_id
        self.model = model
        self.stream = stream
        self.rendered = rendered
        self.lookup = lookup
        self.record = record
        self.arrived = arrived
        self.submitted = submitted  # handed to the engine (or its admission queue)
        # No tool may be called: markers the model writes anyway stay text, never a tool_use block.
        parser = gw.renderer.tool_format.new_parser(rendered.tools) if rendered.tools else TextOnlyParser()
        self.builder = ReplyBuilder(
            gw.tokenizer, gw.renderer.hidden_token_ids, stop_sequences, parser, one_call=rendered.one_call
        )
        self.reader = _EventReader(stream)
        self.stats: RequestStats | None = None
        self.first_token_at: float | None = None
        self.finish_reason: FinishReason | None = None
        self.error: EngineError | None = None
        self.finished = False  # the engine sent its final event
        self.completed = False  # the client got a whole answer
        self._stop_requested = False
        self._closed = False
        self._cut = False  # ended by the server's drain deadline, not by the engine or client
        gw.generations[request_id] = self
        self.user = record.get("user") or ""  # its in-flight slot was taken before the submit
        if gw.cutting:  # its submit was still waiting on the engine when the drain cut the rest
            self.cut()

    # -- engine side --------------------------------------------------------------------------
    def _consume(self, event: TokenEvent) -> list[dict[str, Any]]:
        if event.token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if event.stats is not None:
            self.stats = event.stats
        events = self.builder.push(event.token_ids) if event.token_ids else []
        if event.finished:
            self.finished = True
            self.finish_reason = event.finish_reason
            self.error = event.error if event.finish_reason == FinishReason.ERROR else None
            if self.finish_reason == FinishReason.ERROR and self.error is None:
                self.error = EngineError("the engine failed this request")
            if self.finish_reason == FinishReason.ABORT and not self._stop_requested:
                # An abort nobody here asked for (a stop sequence, the one call allowed): the
                # engine stopped (shutdown, its thread gone). The reply is cut: an error the
                # client retries, not a finished answer.
                self.error = event.error or EngineShutdown()
            if self._cut and self.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
                self.error = EngineShutdown()  # an overloaded error the client may retry
        elif self.builder.done and not self._stop_requested:  # a stop sequence matched
            self._stop_requested = True
            self.gw.engine.abort(self.request_id)
        return events

    def _usage(self, final: bool) -> dict[str, int]:
        prompt = len(self.rendered.token_ids)
        cached = self.stats.cached_tokens if (final and self.stats is not None) else self.lookup.cached_tokens
        return {
            "input_tokens": prompt - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": len(self.builder.generated_ids) if final else 0,
        }

    def _stop_reason(self) -> str:
        if self.builder.stop_sequence is not None:
            return "stop_sequence"
        if self.finish_reason == FinishReason.LENGTH and not self.builder.one_call_done:
            # A call cut by the limit has lost arguments: "max_tokens" lets the client recover
            # where "tool_use" would have it run the truncated call.
            if "summary_max_tokens" in self.record:
                # A compaction summary cut at the server's cap is final: "max_tokens" would make
                # Claude Code ask it to go on, re-reading the conversation for each continuation.
                return "end_turn"
            if "window_max_tokens" in self.record:
                # Cut by the context window before max_tokens: the API's own stop reason for it.
                # Claude Code 2.1.332 then says the model reached its context window limit; for
                # "max_tokens" it tells the user to raise CLAUDE_CODE_MAX_OUTPUT_TOKENS.
                return "model_context_window_exceeded"
            return "max_tokens"
        return "tool_use" if self.builder.called_tool else "end_turn"

    def _message(self, content: list[dict[str, Any]], final: bool) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": self._stop_reason() if final else None,
            "stop_sequence": self.builder.stop_sequence if final else None,
            "usage": self._usage(final),
        }

    # -- streaming ----------------------------------------------------------------------------
    async def sse(self) -> AsyncIterator[bytes]:
        ping = self.gw.settings.ping_interval_s
        try:
            yield sse_event({"type": "message_start", "message": self._message([], final=False)})
            # A ping after `ping` seconds without a byte to the client, whether or not the engine
            # was busy: hidden reasoning, a tool argument held whole, or whitespace produce no
            # event for a long while, and a proxy's idle timeout cuts a silent stream.
            last_sent = time.monotonic()
            while not self.finished:
                event = await self.reader.next(max(0.0, ping - (time.monotonic() - last_sent)))
                items = [] if event is None else self._consume(event)
                for item in items:
                    yield sse_event(item)
                if items:
                    last_sent = time.monotonic()
                elif time.monotonic() - last_sent >= ping:
                    yield PING
                    last_sent = time.monotonic()
            if self.error is not None:
                yield sse_event(from_engine_error(self.error).body())
                return
            for item in self.builder.finish():
                yield sse_event(item)
            delta = {"stop_reason": self._stop_reason(), "stop_sequence": self.builder.stop_sequence}
            yield sse_event({"type": "message_delta", "delta": delta, "usage": self._usage(final=True)})
            yield sse_event({"type": "message_stop"})
            self.completed = True
        except Exception:  # a bug of ours: the client still gets a well-formed end of stream
            logger.exception("request %s failed while streaming", self.request_id)
            self.error = self.error or EngineError("internal error")
            yield sse_event(APIError(500, "internal server error").body())
        finally:
            self.close()

    # -- non-streaming ------------------------------------------------------------------------
    async def collect(self, request: Request) -> Response:
        # Watch the connection while the answer is being made: a client that hangs up must stop
        # the engine's work now, not when the reply is done (close() aborts an unfinished one).
        gone = asyncio.ensure_future(client_disconnected(request))
        try:
            while not self.finished:
                event = await self.reader.next(self.gw.settings.ping_interval_s, interrupt=gone)
                if gone.done():
                    return Response(status_code=499)
                if event is None:
                    continue
                self._consume(event)
            if self.error is not None:
                raise from_engine_error(self.error)
            self.builder.finish()
            response = JSONResponse(self._message(self.builder.content, final=True))
            self.completed = True  # only once the answer could be written
            return response
        except APIError:
            raise
        except Exception:  # a bug of ours: logged as such, not as a client that left
            self.error = self.error or EngineError("internal error")
            raise
        finally:
            gone.cancel()
            self.close()

    # -- bookkeeping --------------------------------------------------------------------------
    def cut(self) -> None:
        """Stop at the drain deadline: the client gets an overloaded error it may retry elsewhere."""
        if not self.finished and not self._cut:
            self._cut = True
            self.gw.engine.abort(self.request_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.reader.close()
        gw = self.gw
        gw.generations.pop(self.request_id, None)
        if not self.finished:  # the client went away: free the engine's sequence now
            gw.engine.abort(self.request_id)
        release_slot(gw, self.user)
        # The generated ids stand for the reply only when nothing was cut from it: past a stop
        # sequence, or after the one call allowed, they hold text the client never got.
        if self.completed and not self.builder.done:
            try:
                gw.renderer.remember_reply(self.rendered, self.builder.content, self.builder.generated_ids)
            except Exception:
                logger.exception("could not remember the reply of %s", self.request_id)
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrived
        gw.metrics.observe_generation(
            self.stats, ttft, self.queue_wait_s, len(self.builder.generated_ids), self.record.get("user")
        )
        if self.record.get("compaction"):
            gw.metrics.observe_compaction(self.stats, ttft, len(self.builder.generated_ids))
        self._write_record(ttft)

    def outcome_status(self) -> int:
        """The status a closed stream counts under: 200 answered, 499 its client left, else the
        status its error would have had before the stream began."""
        if self.completed:
            return 200
        if self.error is not None:
            return from_engine_error(self.error).status
        return CLIENT_CLOSED

    @property
    def queue_wait_s(self) -> float | None:
        """From submit until the engine allocated the request: the admission queue (cold cap,
        memory gate, session slots) and the engine's own. The engine's queue_wait_s starts only
        when the engine got it, after admission let it through."""
        stats = self.stats
        if stats is None or stats.admitted_at is None:
            return None
        return max(0.0, stats.admitted_at - self.submitted)

    def _write_record(self, ttft: float | None) -> None:
        stats = self.stats
        record = self.record
        record.update(
            prompt_tokens=len(self.rendered.token_ids),
            tokenized_tokens=self.rendered.fresh_tokens,
            cached_tokens_device=stats.cached_tokens_device if stats else 0,
            cached_tokens_host=stats.cached_tokens_host if stats else 0,
            hit_rate=round(stats.hit_rate, 4) if stats else 0.0,
            # warm/cold as the metrics label it, so queue wait and TTFT can be split by class
            cache_class="warm" if stats and stats.hit_rate >= WARM_HIT_RATE else "cold",
            queue_wait_ms=_ms(self.queue_wait_s),
            ttft_ms=_ms(ttft),
            duration_ms=_ms(time.monotonic() - self.arrived),
            output_tokens=len(self.builder.generated_ids),
            stop_reason=self._stop_reason() if self.completed else None,
            error=None if self.completed else (str(self.error) if self.error else "client disconnected"),
        )
        if self.gw.settings.log_prompts:
            record["prompt_token_ids"] = self.rendered.token_ids
            record["output_token_ids"] = self.builder.generated_ids
            record["output"] = self.builder.content
        self.gw.log.write(record)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def take_slot(gw: Gateway, user: str) -> None:
    """Count a request in flight (the concurrency caps and the drain read these) from before its
    submit, which may wait on the engine, until its Generation closes."""
    gw.in_flight += 1
    gw.in_flight_by_user[user] += 1
    gw.metrics.in_flight.inc()


def release_slot(gw: Gateway, user: str) -> None:
    gw.in_flight -= 1
    gw.in_flight_by_user[user] -= 1
    if not gw.in_flight_by_user[user]:
        del gw.in_flight_by_user[user]
    gw.metrics.in_flight.dec()
