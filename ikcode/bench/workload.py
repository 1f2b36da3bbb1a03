"""Synthetic coding agents: the load shape shared by the live and the simulated bench.

An agent works through conversations. Each conversation starts with a large context read from
zero (the repository, the instructions, the files: a cold turn), then runs steps: the model
answers (output tokens), a tool runs (a pause), its result is appended (tokens per step), and
the whole conversation is sent again (a warm turn: all but the new tokens are cached). After
`steps_per_conversation` steps the agent starts a fresh conversation (a new task, or the
client compacting): cold again.

Every agent draws from its own seeded generator, so a run is reproducible whatever order the
engine serves it in.

The defaults are the published 100-agent run's load shape, derived from its figures:
- 96% of tokens from cache: a conversation's one cold read is ~1/steps of its reads, so
  32 steps (plus ~0.5% of appended tokens) leave ~4.5% computed.
- 1.8M tokens/s read by 100 agents of ~460K: ~4 turns/s, a turn every ~25 s per agent =
  ~2.6 s to first token + 200 output tokens at ~35 tokens/s (~6 s) + tool pauses (median 4 s,
  lognormal, mean ~6.6 s) + queueing.
- p95 of 37 s with a 2.55 s median: the tail is the start, when the agents' brand-new
  conversations arrive together (30 s ramp: 45M cold tokens, ~4 minutes of prefill) and warm
  turns queue behind them; the run lasts 12.5 minutes, so that burst is ~5-8% of the turns.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class AgentsWorkload:
    agents: int = 100
    context_tokens: int = 450_000  # conversation size at its first turn
    tokens_per_step: int = 2_000  # median tokens a step appends (tool result, user text)
    output_tokens: int = 200  # median output tokens per turn
    tool_pause_s: float = 4.0  # median tool pause between a reply and the next turn
    pause_sigma: float = 1.0  # lognormal spread of pauses, appended tokens and outputs
    steps_per_conversation: int = 32  # turns before the agent starts a fresh conversation
    ramp_s: float = 30.0  # agents start at uniformly random times over this many seconds
    duration_s: float = 750.0  # no new turns start after this
    seed: int = 0
    max_attempts: int = 10  # a shed turn is retried after retry-after, this many times in all

    @property
    def initial_context_tokens(self) -> int:
        """The size of a conversation's first (cold) turn; it grows by each step from there."""
        return self.context_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Turn:
    agent: int
    conversation: int  # globally unique id of the conversation
    step: int  # 0 = the conversation's first (cold) turn
    prompt_tokens: int
    output_tokens: int
    at: float  # when the agent sends it


class AgentScript:
    """The decisions of one agent; the runner tells it when a turn finished."""

    def __init__(self, workload: AgentsWorkload, agent: int):
        self.w = workload
        self.agent = agent
        self.rng = random.Random(workload.seed * 1_000_003 + agent)
        self.conversations = 0
        self.step = 0
        self.length = 0  # tokens of the current conversation so far

    def _lognormal(self, median: float) -> float:
        if median <= 0:
            return 0.0
        return median * math.exp(self.rng.gauss(0.0, self.w.pause_sigma))

    def _new_conversation(self) -> int:
        self.conversations += 1
        self.step = 0
        # Initial contexts vary +-10% so that agents do not move in lockstep.
        self.length = int(self.w.initial_context_tokens * self.rng.uniform(0.9, 1.1))
        return self.agent * 100_000 + self.conversations

    def first_turn(self) -> Turn:
        # Agents join at random over the ramp (independent starts, as users and CI jobs do).
        start = self.rng.uniform(0.0, self.w.ramp_s)
        conversation = self._new_conversation()
        return Turn(self.agent, conversation, 0, self.length, self._output(), start)

    def _output(self) -> int:
        return max(1, int(self._lognormal(self.w.output_tokens)))

    def next_turn(self, done: Turn, finished_at: float, output_tokens: int | None = None) -> Turn | None:
        """The turn after `done` finished at finished_at; None when the run is over for this agent."""
        at = finished_at + self._lognormal(self.w.tool_pause_s)
        if at >= self.w.duration_s:
            return None
        produced = done.output_tokens if output_tokens is None else output_tokens
        if done.step + 1 >= self.w.steps_per_conversation:
            conversation = self._new_conversation()
            return Turn(self.agent, conversation, 0, self.length, self._output(), at)
        added = max(1, int(self._lognormal(self.w.tokens_per_step)))
        self.length = done.prompt_tokens + produced + added
        self.step = done.step + 1
        return Turn(self.agent, done.conversation, self.step, self.length, self._output(), at)
