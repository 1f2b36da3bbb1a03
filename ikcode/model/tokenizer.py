"""The tokenizer: a `tokenizers.Tokenizer` plus what serving needs around it.

Built from a GGUF's metadata (vocabulary, merges, token types, pre-tokenizer name), from a
Hugging Face `tokenizer.json`, or from a small vocabulary for tests. Encoding never adds BOS:
the chat template writes whatever the model expects.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from ikcode.model.errors import ModelLoadError

__all__ = ["Tokenizer", "CHATML_TEMPLATE", "byte_level_alphabet"]

# A ChatML template (the format of SmolLM2 and Qwen2) for tokenizers built in tests.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

# Tokens that end a turn in common chat formats; added to the EOS set when the vocabulary marks
# them special, as llama.cpp does for end-of-generation tokens.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<|end_of_text|>")
# gpt-oss (harmony) ends every message with <|end|>, its reasoning included, and its turn with
# <|return|> (an answer) or <|call|> (a tool call): "<|return|> indicates the end of generation, but
# <|end|> does not" (its chat template, tests/data/chat_templates/gpt_oss.jinja:308). A vocabulary with both
# is harmony's: they end generation and <|end|> does not, whatever the file's eos/eot says
# (llama.cpp's vocabulary loader treats it the same way).
HARMONY_END_OF_GENERATION = ("<|return|>", "<|call|>")
HARMONY_MESSAGE_END = "<|end|>"


def _end_of_generation(eos: list[int | None], specials: Sequence[str], token_id) -> list[int | None]:
    """eos ids (from the file) plus the specials that end a turn in the vocabulary's format."""
    if all(t in specials for t in HARMONY_END_OF_GENERATION):
        message_end = token_id(HARMONY_MESSAGE_END)
        kept = [i for i in eos if i != message_end]
        return kept + [token_id(t) for t in (*HARMONY_END_OF_GENERATION, "<|endoftext|>") if t in specials]
    return eos + [token_id(t) for t in END_OF_TURN_TOKENS if t in specials]


# Pre-tokenizer splits by GGUF `tokenizer.ggml.pre` name (the regexes llama.cpp uses for them).
_GPT2_STYLE = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"qwen2": _QWEN2, "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3}
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (how byte-level vocabularies spell bytes)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0x100))
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(byte)
        else:
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(c) for byte, c in enumerate(chars)}


@lru_cache(maxsize=1)
def _byte_of_character() -> dict[str, int]:
    return {c: b for b, c in byte_level_alphabet().items()}


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex
    if pre == "smollm":  # SmolLM's tokenizer.json: every digit its own pre-token, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


# Added tokens shaped like a chat or tool marker: <|im_end|>, <tool_call>, [INST], [/INST].
_MARKER = re.compile(r"<[^<>\s]+>|\[/?[A-Z_]+\]")


def _markers_special(tokenizer_json: str) -> str:
    """The vocabulary with every marker-shaped added token flagged special: encode_special_tokens
    leaves only special ones as text, and a fine-tune that added <|im_end|> as a plain token
    (HF `special: false`, a GGUF user-defined token) let user text close its own turn."""
    data = json.loads(tokenizer_json)
    for token in data.get("added_tokens") or []:
        if _MARKER.fullmatch(str(token.get("content", ""))):
            token["special"] = True
    return json.dumps(data)


@dataclass
class Tokenizer:
    backend: BackendTokenizer
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        # A twin that treats special-token text as plain text (for untrusted content).
        self._literal = BackendTokenizer.from_str(_markers_special(self.backend.to_str()))
        self._literal.encode_special_tokens = True

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, object]) -> Tokenizer:
        """From GGUF `tokenizer.*` metadata values (byte-level BPE vocabularies only)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(
                f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE, 'gpt2', is supported); "
                "use a Hugging Face checkpoint directory with tokenizer.json instead"
            )
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])  # type: ignore[call-overload]
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))  # type: ignore[call-overload]
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]  # type: ignore[union-attr]
        entries = list(zip(tokens, types, strict=True))
        spelling = byte_level_alphabet()
        alphabet = set(spelling.values())
        vocab: dict[str, int] = {}
        for index, (token, kind_) in enumerate(entries):
            if kind_ not in (_GGUF_CONTROL, _GGUF_USER_DEFINED) and not set(token) <= alphabet:
                token = "".join(spelling[b] for b in token.encode("utf-8"))  # stored as raw text
            vocab.setdefault(token, index)
        pre = str(meta.get("tokenizer.ggml.pre") or "default")
        llama3_style = pre in ("llama-bpe", "llama3", "llama-v3")  # llama.cpp ignores merges for these
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=llama3_style))
        backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        specials = [t for t, k in entries if k == _GGUF_CONTROL]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        user_defined = [t for t, k in entries if k == _GGUF_USER_DEFINED]
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
        eos = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
        eos = _end_of_generation(eos, specials, backend.token_to_id)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        template = meta.get("tokenizer.chat_template")
        return cls(
            backend=backend,
            eos_token_ids=_unique_ids(eos),
            bos_token_id=int(bos) if bos is not None else None,  # type: ignore[call-overload]
            chat_template=str(template) if template is not None else None,
        )

    @classmethod
    def from_tokenizer_json(
        cls,
        tokenizer_json: str,
        tokenizer_config: dict | None = None,
        extra_eos_ids: Sequence[int] = (),
    ) -> Tokenizer:
        """From the text of a Hugging Face `tokenizer.json` and its `tokenizer_config.json`."""
        backend = BackendTokenizer.from_str(tokenizer_json)
        config = tokenizer_config or {}

        def token_id(entry: object) -> int | None:
            text = entry.get("content") if isinstance(entry, dict) else entry
            return backend.token_to_id(text) if isinstance(text, str) else None

        specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        eos = [token_id(config.get("eos_token")), *extra_eos_ids]
        eos = _end_of_generation(eos, list(specials), backend.token_to_id)
        template = config.get("chat_template")
        if isinstance(template, list):  # the named-templates form: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(
            backend=backend,
            eos_token_ids=_unique_ids(eos),
            bos_token_id=token_id(config.get("bos_token")),
            chat_template=template,
        )

    @classmethod
    def from_vocab(
        cls,
        merges: Sequence[tuple[str, str]] = (),
        special_tokens: Sequence[str] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        eos_tokens: Sequence[str] | None = ("<|im_end|>",),
        chat_template: str | None = CHATML_TEMPLATE,
    ) -> Tokenizer:
        """A small byte-level BPE for tests: ids = special tokens, the 256 bytes, then one per merge.
        eos_tokens None: the end-of-generation set a GGUF with these specials would get.

        Merges are written in byte-level spelling (a space is "Ġ"), e.g. [("h", "e"), ("Ġ", "he")].
        """
        tokens = list(special_tokens) + list(byte_level_alphabet().values())
        tokens += [a + b for a, b in merges if a + b not in tokens]
        meta = {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "smollm",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [_GGUF_CONTROL if t in special_tokens else 1 for t in tokens],
            "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
        }
        built = cls.from_gguf_metadata(meta)
        if eos_tokens is not None:
            built.eos_token_ids = tuple(tokens.index(t) for t in eos_tokens)
        built.chat_template = chat_template
        return built

    # -- serialization (the weight cache keeps a built tokenizer) ------------------------------
    def to_json(self) -> str:
        return json.dumps(
            {
                "backend": self.backend.to_str(),
                "eos_token_ids": list(self.eos_token_ids),
                "bos_token_id": self.bos_token_id,
                "chat_template": self.chat_template,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        data = json.loads(text)
        return cls(
            backend=BackendTokenizer.from_str(data["backend"]),
            eos_token_ids=tuple(data["eos_token_ids"]),
            bos_token_id=data["bos_token_id"],
            chat_template=data["chat_template"],
        )

    # -- use ------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of `text`, no BOS. allow_special=False: "<|im_end|>" in the text is plain text.

        Through encode_batch_fast: tokenizers' `encode` holds the GIL for the whole text
        (bindings/python/src/tokenizer.rs, `fn encode`), its batch calls release it (`py.detach`),
        and the fast one skips the character offsets. A 450K-token conversation takes ~2 s of one
        core to tokenize: with the GIL held, the gateway's event loop and every other request's
        rendering waited for it. The same ids, sooner: one encode of a 450K-token conversation
        in bench/gateway_overhead.py took 1.9 s this way against 3.25 s."""
        backend = self.backend if allow_special else self._literal
        return backend.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def encode_batch(self, texts: Sequence[str], allow_special: bool = True) -> list[list[int]]:
        backend = self.backend if allow_special else self._literal
        return [e.ids for e in backend.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_bytes(self, ids: Sequence[int]) -> bytes | None:
        """The bytes `decode` turns into text, for a byte-level vocabulary; None for any other.
        Text alone cannot tell a character cut in the middle (its first bytes decode as U+FFFD)
        from a U+FFFD the model wrote; the bytes can. The ByteLevel decoder maps each token's
        characters back through GPT-2's alphabet, or takes the token's UTF-8 as it is when a
        character is not in it (an added token such as "<|im_end|>" maps to itself either way),
        then decodes the bytes lossily (huggingface/tokenizers,
        tokenizers/src/pre_tokenizers/byte_level.rs, `impl Decoder for ByteLevel`)."""
        if not isinstance(self.backend.decoder, decoders.ByteLevel):
            return None
        byte_of = _byte_of_character()
        out = bytearray()
        for token_id in ids:
            token = self.backend.id_to_token(token_id) or ""
            spelled = [byte_of.get(c) for c in token]
            out += bytes(spelled) if None not in spelled else token.encode()  # type: ignore[arg-type]
        return bytes(out)

    @property
    def special_token_ids(self) -> dict[str, int]:
        return {t.content: i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}


def _unique_ids(ids: Sequence[object]) -> tuple[int, ...]:
    out: list[int] = []
    for value in ids:
        if value is not None and int(value) not in out:  # type: ignore[call-overload]
            out.append(int(value))  # type: ignore[call-overload]
    return tuple(out)
