"""One user's cache never serves another: two named users on a real server, salting on by default.

Alice's prompt, sent again by Bob, must be a full miss for Bob (usage and the request log agree),
while Alice's own repeat hits. A property test then drives random interleavings of users and
prompts and checks that every cache read a user is given comes from that user's own history.
"""

from __future__ import annotations

import itertools
import json
import threading

import anthropic
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ikcode.gateway import GatewaySettings, create_app
from ikcode.gateway.render import Renderer
from ikcode.gateway.schemas import MessagesRequest
from ikcode.gateway.server import BackgroundServer
from tests.test_gateway_support import tiny_tokenizer, wait_idle
from tests.tiny_model import tiny_engine

TOKENS = {
    "alice": "ik-alice-token-0123456789",
    "bob": "ik-bob-token-0123456789",
    "carol": "ik-carol-0123456789",
}
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = tiny_engine(kv_memory_bytes=4 * 1024 * 1024)
    engine.start()
    log_path = tmp_path_factory.mktemp("security") / "requests.jsonl"
    # No cache_salt_per_user here: several tokens can connect, so salting must be on by default.
    gateway_settings = GatewaySettings(
        served_model=MODEL,
        max_output_tokens=8,
        default_temperature=0.0,
        auth_tokens=dict(TOKENS),
        request_log_path=log_path,
        log_prompts=True,  # the prompt's token ids in the log: what each user's cache could hold
    )
    app = create_app(engine, tiny_tokenizer(), gateway_settings)
    background = BackgroundServer(app).start()
    yield background, engine, log_path
    background.stop()
    engine.shutdown(drain_timeout_s=1)


def client(server, user: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server[0].url, api_key=TOKENS[user], max_retries=0)


def ask(server, user: str, text: str) -> tuple[anthropic.types.Message, dict]:
    """One request; returns the reply and its request-log line (after the engine let go)."""
    reply = client(server, user).messages.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": text}]
    )
    wait_idle(server[1])  # the cache commits at release: the next request sees this one's entries
    lines = server[2].read_text().splitlines()
    record = next(r for r in map(json.loads, reversed(lines)) if r["request_id"] == reply.id)
    return reply, record


def cached(record: dict) -> int:
    return record["cached_tokens_device"] + record["cached_tokens_host"]


def test_two_users_never_share_cache_entries(server):
    prompt = "Alice's private notes: the launch code is " + "swordfish " * 20
    first, first_record = ask(server, "alice", prompt)
    assert first.usage.cache_read_input_tokens == 0 and first_record["user"] == "alice"

    mine, mine_record = ask(server, "alice", prompt)
    assert mine.usage.cache_read_input_tokens > 0  # the cache works: her own repeat hits
    assert cached(mine_record) == mine.usage.cache_read_input_tokens

    theirs, theirs_record = ask(server, "bob", prompt)
    assert theirs_record["user"] == "bob"
    assert theirs.usage.cache_read_input_tokens == 0, "Bob was served Alice's cache entries"
    assert theirs.usage.input_tokens == mine.usage.input_tokens + mine.usage.cache_read_input_tokens
    assert cached(theirs_record) == 0

    # Streamed, the hit is announced in message_start: Bob must not learn of Alice's prompt there.
    with client(server, "bob").messages.stream(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": prompt + "?"}]
    ) as stream:
        events = list(stream)
    start = next(e for e in events if e.type == "message_start")
    wait_idle(server[1])
    # Bob's own previous request shares the prefix now: only his own entries may be read.
    assert start.message.usage.cache_read_input_tokens <= theirs.usage.input_tokens

    health = client(server, "alice").get("/health", cast_to=object)
    assert health["cache_salt_per_user"] is True
    # Each user sees his own figures, not who else uses the server or how much.
    assert list(health["users"]) == ["alice"]
    assert health["users"]["alice"]["cached_tokens"] == mine.usage.cache_read_input_tokens
    assert list(client(server, "bob").get("/health", cast_to=object)["users"]) == ["bob"]
    metrics = httpx.get(server[0].url + "/metrics", headers={"x-api-key": TOKENS["bob"]}).text
    assert "ikcode_requests_total" in metrics and "ikcode_user_" not in metrics


NONCE = itertools.count()
BASES = ("a", "b", "c")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def own_history_bound(log_path, record: dict) -> int:
    """The most tokens this request could find cached if only its own user's earlier prompts
    (whole chat template included) ever reached its cache."""
    best = 0
    for earlier in map(json.loads, log_path.read_text().splitlines()):
        if earlier["request_id"] == record["request_id"]:
            break
        if earlier["user"] == record["user"] and "prompt_token_ids" in earlier:
            best = max(best, common_prefix(earlier["prompt_token_ids"], record["prompt_token_ids"]))
    return best


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.lists(st.tuples(st.sampled_from(sorted(TOKENS)), st.sampled_from(BASES)), min_size=2, max_size=6))
def test_cache_reads_come_only_from_the_users_own_history(server, steps):
    nonce = next(NONCE)
    for user, base in steps:
        # Users of this example send the same texts: without salting, the second user to send
        # one would read the first one's entries (a bound far above their own history's).
        reply, record = ask(server, user, f"{base * 40} {nonce} {base * 40}")
        hit = reply.usage.cache_read_input_tokens
        assert hit == cached(record)
        assert hit <= own_history_bound(server[2], record), f"{user} read another user's entries"


def test_property_is_not_vacuous(server):
    """The same user repeating a prompt does hit: the property test's zeros mean isolation."""
    hits = []

    def run() -> None:
        text = f"{'d' * 40} repeat {'d' * 40}"
        for _ in range(2):
            reply, _ = ask(server, "carol", text)
            hits.append(reply.usage.cache_read_input_tokens)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert hits[0] == 0 and hits[1] > 0


def test_a_profile_salts_by_default_once_a_second_token_exists(tmp_path):
    from ikcode import auth, daemon
    from ikcode.profiles import load_profile, shipped_profiles_dir
    from ikcode.stack import gateway_settings

    local = load_profile("local")
    assert not gateway_settings(local, "127.0.0.1", 8192).salts_per_user  # the launcher alone
    auth.add_team_token("alice")
    assert gateway_settings(local, "127.0.0.1", 8192).salts_per_user

    text = (
        (shipped_profiles_dir() / "local.toml")
        .read_text()
        .replace("[cache]\n", "[cache]\nsalt_per_user = false\n")
    )
    shared = tmp_path / "shared.toml"
    shared.write_text(text)
    assert not gateway_settings(load_profile(str(shared)), "127.0.0.1", 8192).salts_per_user

    shared.write_text(text.replace("salt_per_user = false", 'salt_per_user = "no"'))
    with pytest.raises(daemon.DaemonError, match="salt_per_user must be true or false"):
        gateway_settings(load_profile(str(shared)), "127.0.0.1", 8192)


def test_a_previous_render_serves_only_its_own_user(server):
    """A warm turn reuses the conversation's previous render (request log: render_reused_tokens),
    but Bob sending Alice's conversation under her session id renders it from scratch."""
    first = [{"role": "user", "content": "Alice's plan: " + "rotate the keys " * 30}]
    second = first + [
        {"role": "assistant", "content": "noted"},
        {"role": "user", "content": "and then?"},
    ]

    def send(user: str, messages: list[dict]) -> dict:
        reply = client(server, user).messages.create(
            model=MODEL,
            max_tokens=1,
            messages=messages,
            extra_headers={"x-claude-code-session-id": "one-session-id"},
        )
        wait_idle(server[1])
        lines = server[2].read_text().splitlines()
        return next(r for r in map(json.loads, reversed(lines)) if r["request_id"] == reply.id)

    assert send("alice", first)["render_reused_tokens"] == 0
    assert send("alice", second)["render_reused_tokens"] > 0
    assert send("bob", second)["render_reused_tokens"] == 0
    assert send("bob", second)["render_reused_tokens"] > 0  # his own repeat does reuse


def test_a_session_id_is_its_users_own(server):
    """Bob sending Alice's session id is a session of his own: his prompt is not compared with
    hers in the log (prefix_shared_tokens), nor does it take her place (her next turn is still
    compared with her own previous prompt, all of it shared)."""
    alice = [{"role": "user", "content": "Alice's draft: " + "merge the branches " * 20}]
    bob = [{"role": "user", "content": "Bob's draft: " + "merge the branches " * 20}]
    headers = {"x-claude-code-session-id": "a-session-id-both-send"}

    def send(user: str, messages: list[dict]) -> dict:
        reply = client(server, user).messages.create(
            model=MODEL, max_tokens=1, messages=messages, extra_headers=headers
        )
        wait_idle(server[1])
        lines = server[2].read_text().splitlines()
        return next(r for r in map(json.loads, reversed(lines)) if r["request_id"] == reply.id)

    assert "prefix_shared_tokens" not in send("alice", alice)
    bobs = send("bob", bob)
    assert "prefix_shared_tokens" not in bobs and bobs["session_id"] == headers["x-claude-code-session-id"]
    again = send("alice", alice)
    assert again["prefix_shared_tokens"] == again["previous_prompt_tokens"] == again["prompt_tokens"]


def test_a_users_session_key_cannot_be_spelled_by_another_user():
    from ikcode.auth import user_session

    assert user_session("team", "alice/s1") != user_session("team/alice", "s1")
    assert user_session(None, "s1") == "s1" and user_session("alice", None) is None


def test_a_remembered_reply_serves_only_its_own_user(server):
    """An assistant turn the server generated is rendered with the ids it generated (not its
    text's), but only for the user it was generated for: for Bob, Alice's exchange renders from
    its text, so his prompt's length (count_tokens) cannot tell that she had it."""
    question = [{"role": "user", "content": "alice's private question: which key rotates first?"}]
    reply = client(server, "alice").messages.create(model=MODEL, max_tokens=8, messages=question)
    wait_idle(server[1])
    content = [block.model_dump(exclude_none=True) for block in reply.content]
    conversation = question + [{"role": "assistant", "content": content}, {"role": "user", "content": "next"}]

    def prompt_ids(user: str) -> list[int]:
        answer = client(server, user).messages.create(model=MODEL, max_tokens=1, messages=conversation)
        wait_idle(server[1])
        lines = server[2].read_text().splitlines()
        return next(r for r in map(json.loads, reversed(lines)) if r["request_id"] == answer.id)[
            "prompt_token_ids"
        ]

    request = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 1, "messages": conversation})
    from_text = Renderer(tiny_tokenizer()).render(None, None, None, request.messages).token_ids
    assert prompt_ids("alice") != from_text  # her own generated ids: the property is not vacuous
    assert prompt_ids("bob") == from_text
    counted = client(server, "bob").messages.count_tokens(model=MODEL, messages=conversation)
    assert counted.input_tokens == len(from_text)


def test_the_servers_own_token_sees_every_users_figures():
    from ikcode.auth import OWNER

    engine = tiny_engine(kv_memory_bytes=4 * 1024 * 1024)
    engine.start()
    tokens = {OWNER: "ik-owner-0123456789", "alice": TOKENS["alice"]}
    app = create_app(engine, tiny_tokenizer(), GatewaySettings(served_model=MODEL, auth_tokens=tokens))
    background = BackgroundServer(app).start()
    try:
        own = (background, engine, None)
        hi = [{"role": "user", "content": "hi"}]
        client(own, "alice").messages.create(model=MODEL, max_tokens=1, messages=hi)
        wait_idle(engine)
        owner = anthropic.Anthropic(base_url=background.url, api_key=tokens[OWNER], max_retries=0)
        assert "alice" in owner.get("/health", cast_to=object)["users"]
        metrics = httpx.get(background.url + "/metrics", headers={"x-api-key": tokens[OWNER]}).text
        assert 'ikcode_user_prompt_tokens_total{user="alice"}' in metrics
    finally:
        background.stop()
        engine.shutdown(drain_timeout_s=1)


@pytest.mark.parametrize("token", [None, "", "short", 12345])
def test_a_team_token_that_is_not_a_real_secret_is_refused_before_the_model_loads(token, tmp_path):
    """A hand-edited null in tokens.json became the token "None", which anyone could send; the
    file was read only after the model had loaded, and a bad one ended in a traceback."""
    import json

    from ikcode import auth
    from tests.serving import free_port, ikcode, local_profile

    auth.team_tokens_path().parent.mkdir(parents=True, exist_ok=True)
    auth.team_tokens_path().write_text(json.dumps({"bob": token}))
    with pytest.raises(ValueError, match="'bob' is not a string of at least 16"):
        auth.team_tokens()
    started = ikcode("up", "--foreground", "--profile", str(local_profile(tmp_path, free_port())), timeout=60)
    assert started.returncode != 0
    assert "'bob' is not a string of at least 16" in started.stderr and "Traceback" not in started.stderr
