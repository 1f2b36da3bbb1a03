"""Profiles: one TOML file per deployment.

Shipped profiles live in `ikcode/profiles/*.toml`; user profiles in `<config dir>/profiles/*.toml`
override shipped ones of the same name. Anywhere a profile name is accepted, a path to a TOML file
is accepted too. The sections `cache`, `admission`, `hardware` and `upstream` are free-form tables
here: the layers that use them validate their own keys (`deepinfer` too: the DeepInfer adapter's
engine settings, read by ikcode/engines/deepinfer/config.py and by the simulator's ikcode rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ikcode import paths

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

DEFAULT_PROFILE = "local"


class ProfileError(Exception):
    """A profile that cannot be found or read; the message says which file, which key, what fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Endpoint(_Section):
    # Not empty: "" binds every address and gives no URL to reach it by (say 0.0.0.0 for that).
    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(8741, ge=1, le=65535)
    path_prefix: str = ""


class Auth(_Section):
    required: bool = True
    token_file: str = ""  # "" = the launcher's token in the state dir
    # Requests one token may have running at once (more: 429 with retry-after). Unset: no limit
    # on loopback, EXPOSED_REQUESTS_PER_USER when the server listens beyond it.
    max_requests_per_user: int | None = Field(None, ge=1)


class ModelSection(_Section):
    path: str = ""
    threads: int = Field(2, ge=1)
    kv_cache_mb: int = Field(512, ge=1)
    max_num_seqs: int = Field(8, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Decode weights of requests that share a batch: "int8" reads a quarter of fp32's bytes per
    # step, "int4" about a sixth (CPU); see EmbeddedEngineConfig.weights.
    weights: Literal["fp32", "int8", "int4"] = "fp32"
    # Weights of prompt rows and batch-invariant decode rows: "bf16" (native bf16 CPUs: ~2x the
    # prompt speed), "auto" (bf16 where the CPU has it), "fp32"; see EmbeddedEngineConfig.
    float_weights: Literal["fp32", "bf16", "auto"] = "fp32"
    # Whose GEMM multiplies fp32 float weights on a CPU: "onednn" (faster) or "mkl" (torch.mm).
    fp32_gemm: Literal["onednn", "mkl"] = "onednn"
    # Requests whose numbers never depend on the batch: "greedy" (temperature 0), "all", "off".
    batch_invariance: Literal["all", "greedy", "off"] = "greedy"
    # Used when a request names no temperature (Claude Code's main loop never does).
    default_temperature: float = Field(1.0, ge=0.0, le=2.0)
    # Repetition penalties with Ollama's names and llama.cpp's arithmetic (see
    # ikcode/engines/embedded/sampler.py). The defaults leave them off.
    repeat_penalty: float = Field(1.0, gt=0.0, le=2.0)
    repeat_last_n: int = Field(64, ge=0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # How tool calls are written and read (gateway/tool_formats); "" = chosen from the chat template.
    tool_format: Literal["", "hermes", "qwen3_coder", "llama3_json", "mistral", "deepseek_v3", "harmony"] = ""


class ClaudeSection(_Section):
    default_args: list[str] = Field(default_factory=list)
    api_timeout_ms: int = Field(600_000, ge=1000)


class CompactionSection(_Section):
    # `ikcode claude` makes Claude Code compact once its conversation reaches this share of the
    # served window (ikcode/launcher/compaction.py).
    compact_at_fraction: float = Field(0.75, gt=0.0, le=1.0)
    # The gateway caps a compaction (summary) request's output at this many tokens, so that a
    # small model cannot spend minutes on a summary. 0 = no cap beyond max_output_tokens.
    summary_max_tokens: int = Field(0, ge=0)


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = ""
    source: str = ""
    description: str = ""
    engine: Literal["embedded", "deepinfer", "upstream", "simulated"]
    served_model: str = Field(min_length=1)
    context_window: int = Field(gt=0)
    max_output_tokens: int = Field(gt=0)
    endpoint: Endpoint = Field(default_factory=Endpoint)
    auth: Auth = Field(default_factory=Auth)
    model: ModelSection = Field(default_factory=ModelSection)
    claude: ClaudeSection = Field(default_factory=ClaudeSection)
    compaction: CompactionSection = Field(default_factory=CompactionSection)
    cache: dict[str, Any] = Field(default_factory=dict)
    admission: dict[str, Any] = Field(default_factory=dict)
    hardware: dict[str, Any] = Field(default_factory=dict)
    upstream: dict[str, Any] = Field(default_factory=dict)
    deepinfer: dict[str, Any] = Field(default_factory=dict)

    @property
    def base_url(self) -> str:
        """Where this machine's clients reach the server: a server bound to every address
        (0.0.0.0, ::) is reached on loopback (as this machine, which gets the launcher's token)."""
        prefix = self.endpoint.path_prefix.strip("/")
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(
            self.endpoint.host, self.endpoint.host
        )
        if ":" in host and not host.startswith("["):  # IPv6 literal
            host = f"[{host}]"
        url = f"http://{host}:{self.endpoint.port}"
        return f"{url}/{prefix}" if prefix else url


@dataclass(frozen=True)
class ProfileFile:
    name: str
    path: Path
    origin: str  # "shipped" or "user"


def shipped_profiles_dir() -> Path:
    return Path(str(resources.files("ikcode") / "profiles"))


def list_profiles() -> dict[str, ProfileFile]:
    """All known profiles by name; a user profile replaces a shipped one of the same name."""
    found: dict[str, ProfileFile] = {}
    for origin, folder in (("shipped", shipped_profiles_dir()), ("user", paths.user_profiles_dir())):
        if folder.is_dir():
            for path in sorted(folder.glob("*.toml")):
                found[path.stem] = ProfileFile(path.stem, path, origin)
    return found


def _describe_error(path: Path, err: ValidationError) -> str:
    lines = [f"invalid profile {path}:"]
    for item in err.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        elif item["type"] == "missing":
            lines.append(f"  {key}: required key is missing")
        else:
            got = item.get("input")
            lines.append(f"  {key}: {item['msg']} (got {got!r})")
    return "\n".join(lines)


def load_profile_file(path: Path, name: str | None = None) -> Profile:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProfileError(f"profile file not found: {path}") from None
    except tomllib.TOMLDecodeError as err:
        raise ProfileError(f"invalid TOML in profile {path}: {err}") from None
    except UnicodeDecodeError:
        raise ProfileError(f"profile {path} is not UTF-8 text") from None
    except OSError as err:  # a directory, no permission
        raise ProfileError(f"cannot read profile {path}: {err.strerror or err}") from None
    data.pop("name", None)
    data.pop("source", None)
    try:
        profile = Profile.model_validate(data)
    except ValidationError as err:
        raise ProfileError(_describe_error(path, err)) from None
    return profile.model_copy(update={"name": name or path.stem, "source": str(path)})


def load_profile(name_or_path: str | None = None) -> Profile:
    """A profile by name (user dir first, then shipped) or by path to a TOML file."""
    ref = name_or_path or DEFAULT_PROFILE
    candidate = Path(ref).expanduser()
    if ref.endswith(".toml") or "/" in ref:
        return load_profile_file(candidate)
    known = list_profiles()
    if ref not in known and candidate.is_file():  # a file named without .toml, not a profile's name
        return load_profile_file(candidate)
    # A name first: a file called `local` in the directory a command runs in is not the profile.
    if ref not in known:
        names = ", ".join(sorted(known)) or "(none)"
        raise ProfileError(f"unknown profile {ref!r}; known profiles: {names}")
    entry = known[ref]
    return load_profile_file(entry.path, entry.name)
