"""Messages + system + tools -> prompt token ids, append-only and incremental.

The prompt is a chain of segments: [system + tools], then one per message, then the generation
prompt. Each segment begins and ends at a role marker (special tokens), and its content is
tokenized on its own, so the tokens of a conversation are the concatenation of the tokens of its
segments: a warm turn tokenizes only its new messages (the rest come from the store), and the
next request of a conversation starts with exactly this request's tokens plus the reply (whose
generated ids the store keeps, keyed by the chain digest before it and its echoed content).

What is stripped or ignored, on purpose: the `x-anthropic-billing-header` system line (it differs
per conversation and would keep the long system prompt out of the shared cache) and
`cache_control` markers (they move every turn). Mid-conversation system messages stay in place,
and render the same whether sent as a string or as text blocks (Claude Code sends the newest one
as blocks carrying the cache marker, and the same text as a string in later requests).

Deferred tools (`defer_loading: true`) stay out of the tools section: the client lists them by
name and loads one through its ToolSearch tool, whose tool_result holds a `tool_reference` block.
The tool's definition is rendered there, in the conversation, so loading a tool appends to the
prompt instead of changing its start (which would miss the cache for the whole conversation).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Hashable
from typing import Any

from ikcode.gateway.chat_format import (
    OPENED_USER_TURN,
    ROLES,
    SYSTEM_AS_USER_TURN,
    ChatFormat,
    TokenizerLike,
    derive_chat_format,
    turn_role,
)
from ikcode.gateway.content_text import (
    assistant_text,
    call_names,
    guard_strings,
    merge_assistant_turns,
    system_message_text,
    system_text,
    user_items,
    user_text,
)
from ikcode.gateway.conversation_store import ConversationStore
from ikcode.gateway.errors import invalid_request
from ikcode.gateway.folded_head import folded_head
from ikcode.gateway.previous_render import PreviousRender, TurnReads, same_turn, turn_reads
from ikcode.gateway.prompt_chain import (
    PromptBuild,
    RenderedPrompt,
    assistant_content_key,
    digest,
    reply_key,
)
from ikcode.gateway.prompt_encoder import PromptEncoder
from ikcode.gateway.tool_formats import ToolFormat, callable_tools, choice_text, tool_format_for

# Bytes of request a kept render is charged one token for (previous_render.PreviousRender.weight).
BODY_BYTES_PER_TOKEN = 4
# Tag strings that some vocabularies hold as single tokens (Qwen): kept whole when present; the
# tool format adds its own markers.
_TAGS = ("<think>", "</think>")


class Renderer:
    def __init__(
        self,
        tokenizer: TokenizerLike,
        chat_format: ChatFormat | None = None,
        store: ConversationStore | None = None,
        chat_template: str | None = None,
        tool_format: ToolFormat | None = None,
    ):
        self.tokenizer = tokenizer
        template = chat_template or getattr(tokenizer, "chat_template", None)
        self.format = chat_format or derive_chat_format(tokenizer, template)
        self.tool_format = tool_format or tool_format_for(template)
        self.store = store or ConversationStore()
        self.encoder = PromptEncoder(tokenizer, _TAGS + self.tool_format.markers)
        self.guard, self._guards = self.encoder.guard, self.encoder.guards
        fmt = self.format
        self._start_ids = self.encoder.encode(fmt.start, True) if fmt.start else []
        self._prefix_ids = {r: self.encoder.encode(fmt.prefix[r], True) for r in ROLES}
        self._suffix_ids = {r: self.encoder.encode(fmt.suffix[r], True) for r in ROLES}
        # The assistant turn opens exactly like the generation prompt, so a reply fits in place.
        self._prefix_ids["assistant"] = self._gen_ids = self.encoder.encode(fmt.generation_prompt, True)
        # The first user turn when the system prompt opened it (ChatFormat.system_opens_user_turn)
        self._prefix_ids[OPENED_USER_TURN], self._suffix_ids[OPENED_USER_TURN] = [], self._suffix_ids["user"]
        # A system message among the messages when the template has no system turn: a user turn
        self._prefix_ids[SYSTEM_AS_USER_TURN] = self._prefix_ids["user"]
        self._suffix_ids[SYSTEM_AS_USER_TURN] = self._suffix_ids["user"]
        # The template's end-of-turn token stops generation, unless the format's messages end
        # with it inside a turn (harmony's <|end|> closes its reasoning too: see tokenizer.py).
        eot = tokenizer.token_to_id(fmt.end_of_turn) if fmt.end_of_turn else None
        if fmt.end_of_turn in self.tool_format.ends_messages_not_turns:
            eot = None
        eos = tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(((eot,) if eot is not None else ()) + eos))
        # Left out of a reply's text: the stop tokens, and every other control token the model
        # writes except the markers its tool format and think tags are read by (vLLM and
        # llama.cpp do the same). Shown, `<|im_start|>` came back as text in the next turn,
        # tokenized as plain characters: the conversation's cache missed from there on.
        markers = set(self.encoder.tag_ids.values())
        hidden = [i for i in self.encoder.specials.values() if i not in markers]
        self.hidden_token_ids: tuple[int, ...] = tuple(dict.fromkeys(self.stop_token_ids + tuple(hidden)))

    def _segment(self, role: str, key: bytes, text_fn: Any, closed: bool = True) -> tuple[list[int], int]:
        """Token ids of one turn, from the store when known; returns (ids, freshly tokenized)."""
        ids = self.store.segment(key) if closed else None
        if ids is not None:
            return ids, 0
        body = self.encoder.plain(text_fn())
        ids = self._prefix_ids[role] + body + (self._suffix_ids[role] if closed else [])
        if closed:
            self.store.put_segment(key, ids)
        return ids, len(body)

    # -- rendering ----------------------------------------------------------------------------
    def render(
        self,
        system: Any,
        tools: list[Any] | None,
        tool_choice: Any,
        messages: list[Any],
        conversation: Hashable | None = None,
        salt: str = "",
        body_bytes: int = 0,
    ) -> RenderedPrompt:
        """The prompt's token ids. `conversation` (a key under which the caller's earlier requests
        of this conversation were rendered, salted per user) lets the leading turns that equal the
        previous request's take its tokens instead of being digested again; None: no such reuse.
        `salt` (the user's cache salt) scopes the remembered replies: an assistant turn takes the
        ids its own user's request generated, never another user's (whose tokens, unlike a text's,
        say that the other user had this exchange). `body_bytes`: the size of the request the
        messages were parsed from, what the render kept for the conversation holds in memory."""
        if not messages:
            raise invalid_request("messages: at least one message is required")
        deferred = {tool.name: tool for tool in tools or [] if getattr(tool, "defer_loading", None)}
        specs = callable_tools(tools or [])  # all of them for the reply's parser: a loaded one may be called
        turns = merge_assistant_turns(messages)
        prompt, opened = self._render_head(system, specs, deferred, tool_choice, turns[0][0] == "user")
        head_chain, num_head_boundaries = prompt.chain, len(prompt.boundaries)
        names = call_names(turns)
        first, previous = 0, None
        if conversation is not None:
            first, previous = self._reusable(conversation, head_chain, turns, names, deferred)
        reads: TurnReads = ([], [], [])
        if previous is not None:
            prompt = PromptBuild.copied(previous, first, fresh=prompt.fresh)
            reads = previous.reads_before(first)
        reused_tokens = len(prompt.ids) if previous is not None else 0
        prefill = False
        for index in range(first, len(turns)):
            role, content = turns[index]
            if conversation is not None:
                for kept, new in zip(reads, turn_reads(index, role, content, names, deferred), strict=True):
                    kept.extend(new)
            prefill = role == "assistant" and index == len(turns) - 1
            as_role = turn_role(self.format, role, opened and index == 0)
            self._render_turn(prompt, as_role, content, names, deferred, prefill, salt)
        if not prefill:
            prompt.ids.extend(self._gen_ids)
        if conversation is not None:
            closed = len(turns) - prefill
            render = PreviousRender(
                head_chain,
                num_head_boundaries,
                turns[:closed],
                prompt.ids,
                prompt.boundaries,
                *reads,
                weight=max(len(prompt.ids), body_bytes // BODY_BYTES_PER_TOKEN),
            )
            self.store.put_render(conversation, render, replacing=previous)
        return RenderedPrompt(
            prompt.ids,
            None if prefill else reply_key(salt, prompt.chain),
            prompt.fresh,
            num_head_boundaries + len(turns),
            prompt.boundaries,
            [] if getattr(tool_choice, "type", None) == "none" else specs,
            reused_tokens,
            previous.token_ids if previous is not None else None,
            bool(getattr(tool_choice, "disable_parallel_tool_use", None)),
        )

    def _render_head(
        self,
        system: Any,
        specs: list[dict[str, Any]],
        deferred: dict[str, Any],
        tool_choice: Any,
        user_first: bool,
    ) -> tuple[PromptBuild, bool]:
        """The start and the system segment (system prompt and the listed tools), and whether it
        opened the first user turn (folded_head.py; user_first: the first message is the user's)."""
        prompt = PromptBuild(list(self._start_ids))
        sys_text = self.guard(system_text(system))
        # Tool definitions come from the client and its MCP servers: guarded like its text.
        listed = [guard_strings(s, self.guard) for s in specs if s["function"]["name"] not in deferred]
        sys_prefix = self.format.prefix["system"]
        tools_text = self.tool_format.tools_text(listed) if listed else ""
        choice = self.guard(choice_text(tool_choice)) if listed else ""  # it names a tool: client text
        if self.format.system_opens_user_turn:
            head = folded_head(self.format, self.tool_format, sys_text, tools_text, choice, user_first)
            if head is not None:
                prompt.add(head.key, *self._marked_segment(head.key, head.parts))
            return prompt, head is not None and head.opens_user_turn
        if listed:
            sys_text = self.tool_format.system_text(
                sys_text, tools_text + ("\n\n" + choice if choice else "")
            )
            sys_prefix = self.tool_format.system_prefix(sys_prefix)
        if sys_text and sys_prefix != self.format.prefix["system"]:
            # Its own tag and the prefix's length: "system\0" + prefix + "\0" + text was also the
            # key of a plain system prompt spelling prefix + "\0" + text, and the segment store is
            # shared by every user (the first request's tokens would have served the other).
            prefix = sys_prefix.encode()
            key = digest(b"system+tools\x00%d\x00" % len(prefix) + prefix + sys_text.encode())
            prompt.add(
                key, *self._marked_segment(key, [(sys_prefix, sys_text, self.format.suffix["system"])])
            )
        elif sys_text:
            key = digest(b"system\x00" + sys_text.encode())
            prompt.add(key, *self._segment("system", key, lambda: sys_text))
        return prompt, False

    def _render_turn(
        self,
        prompt: PromptBuild,
        role: str,
        content: Any,
        names: dict[str, str],
        deferred: dict[str, Any],
        prefill: bool,
        salt: str = "",
    ) -> None:
        """Append one turn; a prefill (a final assistant turn) stays open and gets no boundary."""
        if role == "assistant":
            replied = assistant_content_key(content)
            reply = None if prefill else self.store.reply(reply_key(salt, prompt.chain), replied)
            if reply is not None:
                seg, n = reply, 0
            else:
                # Keyed by the very text it renders to (the store is shared by every user and
                # conversation): a key of the blocks (sorted inputs, empty texts skipped) gave
                # two turns rendering differently one key, and one took the other's tokens.
                # Not guarded: the model's own words, sent back. Its think tags and markers were
                # control tokens when it wrote them, and must render as the ids it generated.
                text = assistant_text(content, self.tool_format)
                key = digest(b"assistant\x00" + text.encode())
                seg, n = self._segment("assistant", key, lambda: text, not prefill)
            # An assistant turn's tokens are the generated ids while the store remembers them,
            # else its text's: the chain follows the tokens, so that equal digests keep meaning
            # equal token prefixes (block hashing resumes from them).
            key = b"t" + digest(array("q", seg).tobytes())
        elif role == "user" and (parts := self._result_parts(content, names, deferred)) is not None:
            key = digest(b"results\x00" + json.dumps(parts).encode())
            seg, n = self._marked_segment(key, parts)
        else:
            if role in ("user", OPENED_USER_TURN):
                text = user_text(content, names, deferred, self.tool_format, self._guards)
            else:
                text = self.guard(system_message_text(content))
            key = digest(role.encode() + b"\x00" + text.encode())
            seg, n = self._segment(role, key, lambda: text)
        prompt.add(key, seg, n, boundary=not prefill)

    def _reusable(
        self,
        conversation: Hashable,
        head_chain: bytes,
        turns: list[Any],
        names: dict[str, str],
        deferred: dict[str, Any],
    ) -> tuple[int, PreviousRender | None]:
        """The conversation's previous render that shares the most leading turns, and how many."""
        best, best_turns = None, 0
        for previous in reversed(self.store.previous_renders(conversation)):  # newest first
            # Only one that also matches turn `best_turns` can do better: checked before a full pass.
            if best is not None and not (
                best_turns < len(previous.turns)
                and best_turns < len(turns)
                and same_turn(turns[best_turns], previous.turns[best_turns])
            ):
                continue
            num_turns = previous.reusable_turns(head_chain, turns, names, deferred)
            if num_turns > best_turns:
                best, best_turns = previous, num_turns
        return best_turns, best

    def remember_reply(self, rendered: RenderedPrompt, content: list[Any], generated_ids: list[int]) -> None:
        """Keep the reply's generated ids for when the client sends this turn back."""
        if rendered.reply_prefix_key is None:
            return
        ids = self.encoder.intern(list(generated_ids))
        while ids and ids[-1] in self.stop_token_ids:
            ids.pop()
        segment = self._gen_ids + ids + self._suffix_ids["assistant"]
        self.store.put_reply(rendered.reply_prefix_key, assistant_content_key(content), segment)

    # -- tool results in turns of their own -------------------------------------------------------
    def _result_parts(
        self, content: str | list[Any], names: dict[str, str], deferred: dict[str, Any]
    ) -> list[tuple[str, str, str]] | None:
        """A user message with tool results, when the format gives results their own turns:
        (prefix, body, suffix) texts, None for the user's markers. None: a plain user turn."""
        if isinstance(content, str) or not any(block.type == "tool_result" for block in content):
            return None
        items = user_items(content, names, deferred, self._guards, self.tool_format.text_joiner)
        results = [value for kind, value in items if kind == "result"]
        turns = self.tool_format.result_turns(results)
        if turns is None:
            return None
        user = self.format.prefix["user"], self.format.suffix["user"]
        parts = [(markers.prefix, body, markers.suffix) for markers, body in turns]
        texts = [value for kind, value in items if kind == "text"]
        if texts:  # text beside the results: a user turn of its own after them
            parts.append((user[0], self.tool_format.user_text([("text", t) for t in texts]), user[1]))
        return parts

    def _marked_segment(self, key: bytes, parts: list[tuple[str, str, str]]) -> tuple[list[int], int]:
        ids = self.store.segment(key)
        if ids is not None:
            return ids, 0
        ids, fresh = [], 0
        for prefix, body, suffix in parts:
            body_ids = self.encoder.plain(body)
            ids += self.encoder.framed(prefix) + body_ids + self.encoder.framed(suffix)
            fresh += len(body_ids)
        self.store.put_segment(key, ids)
        return ids, fresh
