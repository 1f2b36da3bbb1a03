"""The bearer token shared by the launcher and the server.

Generated once, stored in the state dir with mode 0600, never printed in logs. A team server can
hold several named tokens (one per user, revocable) in `tokens.json` beside it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import tempfile
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from ikcode import paths

TOKEN_PREFIX = "ik-"


def token_path() -> Path:
    return paths.state_dir() / "token"


def _private_temp(path: Path, text: str) -> Path:
    """A new 0600 file beside path holding text (complete before anyone can see it at path)."""
    paths.ensure(path.parent)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    return Path(name)


def _write_private(path: Path, text: str) -> None:
    """Replace path with text, mode 0600, atomically: a reader sees the old file or the new one,
    never an empty one (which it would take for no token and replace with its own)."""
    temp = _private_temp(path, text)
    try:
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def load_or_create_token(path: Path | None = None) -> str:
    """The token at path, created on first use. Two processes starting at once (a launcher and
    the server it starts) end up with the same one: the file is created complete or not at all
    (a hard link of a written file), and the one that loses reads the winner's."""
    path = path or token_path()
    for _ in range(3):
        if path.is_file():
            token = path.read_text(encoding="utf-8").strip()
            if token:
                if path.stat().st_mode & 0o077:
                    os.chmod(path, 0o600)
                return token
            _write_private(path, TOKEN_PREFIX + secrets.token_urlsafe(32) + "\n")  # an empty file
            continue
        temp = _private_temp(path, TOKEN_PREFIX + secrets.token_urlsafe(32) + "\n")
        try:
            os.link(temp, path)  # fails if another process created it first: then read theirs
        except FileExistsError:
            continue
        except OSError:  # a file system without hard links: a plain create, never over another's
            if not path.exists():
                os.replace(temp, path)
        finally:
            temp.unlink(missing_ok=True)
    return path.read_text(encoding="utf-8").strip()


def salt_key() -> str:
    """This server's secret for the cache namespaces it names to an upstream server (`cache_salt`),
    created once beside the token (mode 0600): a namespace nobody without it can compute, and
    another front's user of the same name does not share. Copy the file to share namespaces
    between fronts."""
    return load_or_create_token(paths.state_dir() / "cache-salt-key")


def client_token(url: str | None = None) -> str | None:
    """The token this machine's clients (`ikcode claude`, `env`, `settings`, `doctor`) send to
    `url`: IKCODE_TOKEN when set (a team member's own token, for a server on another machine),
    else this machine's launcher token, but only to a server on this machine (None elsewhere: it
    grants everything on this machine's server, and must not travel to another one)."""
    explicit = os.environ.get("IKCODE_TOKEN")
    if explicit:
        return explicit
    if url is not None and not is_loopback(urlsplit(url).hostname or ""):
        return None
    return load_or_create_token()


def rotate_token(path: Path | None = None) -> str:
    path = path or token_path()
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    _write_private(path, token + "\n")
    return token


def tokens_equal(given: str, expected: str) -> bool:
    """Constant-time comparison, so response timing does not reveal a token's prefix."""
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def redact(token: str) -> str:
    return token[:5] + "…" if len(token) > 8 else "…"


# -- named tokens for a team server: one per user, revocable -----------------------------------
def team_tokens_path() -> Path:
    return paths.state_dir() / "tokens.json"


def team_tokens() -> dict[str, str]:
    path = team_tokens_path()
    if not path.is_file():
        return {}
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8") or "{}")
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except ValueError as err:
        raise ValueError(f"{path} is not a token file ({err}): fix it or remove it") from None
    for name, token in data.items():
        # A hand-edited null became the token "None", which anyone could send; a short one guessed.
        if not isinstance(token, str) or len(token.strip()) < MIN_TEAM_TOKEN_CHARS:
            raise ValueError(
                f"{path}: the token of {str(name)[:MAX_TOKEN_NAME_CHARS]!r} is not a string of at least "
                f"{MIN_TEAM_TOKEN_CHARS} characters: `ikcode token --add NAME` makes one"
            )
    return {str(name): token.strip() for name, token in data.items()}


def _save_team_tokens(tokens: dict[str, str]) -> None:
    import json

    _write_private(team_tokens_path(), json.dumps(tokens, indent=2) + "\n")


MAX_TOKEN_NAME_CHARS = 64
MIN_TEAM_TOKEN_CHARS = 16
OWNER = "launcher"  # the name of the server's own token: the one that sees every user's figures


def check_token_name(name: str) -> None:
    """A token's name is its user's name in logs, metrics and cache salts: short and printable."""
    if not name.strip() or name == OWNER:
        raise ValueError("a token name must be non-empty and not 'launcher'")
    if len(name) > MAX_TOKEN_NAME_CHARS or not name.isprintable() or name != name.strip():
        raise ValueError(
            f"a token name must be at most {MAX_TOKEN_NAME_CHARS} printable characters, "
            "without leading or trailing spaces"
        )


def add_team_token(name: str) -> str:
    check_token_name(name)
    tokens = team_tokens()
    if name in tokens:  # replacing it silently would lock its holder out at the next restart
        raise ValueError(f"a token named {name!r} exists: revoke it first (`ikcode token --revoke {name}`)")
    tokens[name] = TOKEN_PREFIX + secrets.token_urlsafe(32)
    _save_team_tokens(tokens)
    return tokens[name]


def revoke_team_token(name: str) -> bool:
    tokens = team_tokens()
    if name not in tokens:
        return False
    del tokens[name]
    _save_team_tokens(tokens)
    return True


def proxied(url: str) -> bool:
    """Whether a request to url may go through the proxy the environment names: never for this
    machine (an HTTPS_PROXY in the shell must not carry a loopback request off to the proxy)."""
    return not is_loopback(urlsplit(url).hostname or "")


def is_loopback(host: str) -> bool:
    """Whether a bind or connect host is this machine only (no token is needed there)."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def user_session(user: str | None, session_id: str | None) -> str | None:
    """The key a session id is remembered by within the server: the user's own. A newline joins
    them (a token name is printable, so "team" + "alice/s1" cannot meet "team/alice" + "s1")."""
    return f"{user}\n{session_id}" if user and session_id else session_id


def forwarded_session_id(session_key: str) -> str:
    """A user's session as the one id a server behind the upstream front sees. The front signs in
    there with its own token for all its users, so a session id passed on as it came would be one
    session there for every user who sent it; a digest of the user's own key keeps them apart (and
    the same for each of that user's turns). UUID-shaped, like Claude Code's own ids."""
    return str(uuid.UUID(bytes=hashlib.blake2b(session_key.encode(), digest_size=16).digest()))
