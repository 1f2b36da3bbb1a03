"""Errors raised at the engine boundary: typed, with the numbers, never a crash of the engine
thread. The gateway maps them to Anthropic error shapes."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error an engine reports for one request.

    A DeepInfer rank sends them to the gateway through a pipe, so each must survive pickling:
    pickle rebuilds an exception as cls(*self.args), and a subclass whose constructor takes other
    arguments than its message says how to rebuild it in __reduce__ (a failed unpickle killed the
    thread that reads the rank's pipe)."""


class PromptTooLong(EngineError):
    def __init__(self, prompt_tokens: int, max_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        # This wording is what Claude Code looks for to trigger its own compaction.
        super().__init__(f"prompt is too long: {prompt_tokens} tokens > {max_tokens} maximum")

    def __reduce__(self) -> tuple:
        return type(self), (self.prompt_tokens, self.max_tokens)


class EmptyPrompt(EngineError):
    def __init__(self) -> None:
        super().__init__("prompt is empty: at least one token is required")

    def __reduce__(self) -> tuple:
        return type(self), ()


class TokenOutOfVocab(EngineError):
    def __init__(self, token_id: int, vocab_size: int, position: int):
        self.token_id = token_id
        self.vocab_size = vocab_size
        self.position = position
        super().__init__(
            f"token id {token_id} at position {position} is outside the vocabulary [0, {vocab_size})"
        )

    def __reduce__(self) -> tuple:
        return type(self), (self.token_id, self.vocab_size, self.position)


class InvalidSampling(EngineError):
    """A sampling parameter out of range (max_tokens <= 0, top_p outside (0, 1], ...)."""


class EngineOverloaded(EngineError):
    """The engine cannot take the request now (no KV memory, queue full). Retryable."""

    def __init__(self, message: str, retry_after_s: int = 5):
        self.retry_after_s = retry_after_s
        super().__init__(message)

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.retry_after_s)


class EngineShutdown(EngineError):
    def __init__(self) -> None:
        super().__init__("engine is shutting down")

    def __reduce__(self) -> tuple:
        return type(self), ()
