"""Settings of the DeepInfer adapter, and the environment its ranks run with."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ikcode.cache.policy import make_policy

DEFAULT_SNAPSHOT_CACHE_MB = 8192  # [cache] snapshot_cache_mb: all ranks together
KVSTORE_GRAIN = 128  # DeepInfer's KV block: 128 tokens (model_metadata_utils.py:133-135)

# What a resumed prefix needs (facts: "What a resumed prefix needs"), plus the deterministic
# settings the quality gate relies on (cached and cold answers equal at temperature 0).
REQUIRED_ENVIRONMENT: dict[str, str] = {
    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "compact",  # bounded replay; the loader asserts it
    "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "140",
    "DEEPINFER_PREFILL_STORE_EXTRA_STATE": "1",  # keep the window at the last 128 boundary
    "DEEPINFER_BATCH_INVARIANT": "1",
    "DEEPINFER_ENABLE_MTP_VARLEN": "0",
}
# What the adapter's resume path relies on (the loader asserts the compact truncation; the window
# is kept only with the extra state): not for a profile's [deepinfer] environment to change.
FIXED_ENVIRONMENT = ("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "DEEPINFER_PREFILL_STORE_EXTRA_STATE")


# The [deepinfer] profile keys: how the adapter sets DeepInfer's own step scheduling.
SCHEDULE_KEYS = ("max_num_batched_tokens", "prefill_attempt_interval", "prefill_any_attempt_interval")
# ... and how long the adapter waits for its ranks: to start, and before it takes a silent one for hung.
WATCH_KEYS = ("rank_start_timeout_s", "hung_rank_s")


@dataclass
class DeepInferConfig:
    model: str  # local Hugging Face folder of DeepSeek-V4.1-Flash
    data_parallel_size: int = 1
    max_model_len: int = 131072  # DeepInfer's default is 4096: always set it explicitly
    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.9
    # DeepInfer's chunked_prefill is a bool (arg_utils.py:42); the chunk is max_num_batched_tokens,
    # which defaults to max_model_len (config.py:228).
    chunked_prefill: bool = True
    max_num_batched_tokens: int | None = 131072
    # Decode steps between prefill votes: when every rank has prefill work / when any has
    # (SchedulerConfig, config.py:193-194, read by the C++ scheduler at scheduler.hpp:105-108 and
    # voted on at :306-336). DeepInfer's defaults (70 / 100, environ.py:174,177) make a warm turn
    # wait up to 100 decode steps; None keeps them. Passed to each rank as its environment.
    prefill_attempt_interval: int | None = 20
    prefill_any_attempt_interval: int | None = 40
    served_model: str = "deepseek-v4.1-flash"
    eos_token_ids: tuple[int, ...] | None = None  # None: read from <model>/config.json
    vocab_size: int | None = None  # None: read from <model>/config.json
    seed: int = 0  # seq_seed of every request: deterministic sampling
    # The cache on DeepInfer.
    gpu_tier_fraction: float = 0.6  # share of a rank's KV blocks the cache may keep pinned
    # Host RAM per rank for the host tier, in bytes: each rank divides it by its own page size
    # (measured: one row of gpu_blocks). host_tier_blocks_per_rank, if set, gives the pages instead.
    host_tier_bytes_per_rank: int = 0
    host_tier_blocks_per_rank: int = 0  # 128-token pages of host RAM per rank (0 = no host tier)
    # Host RAM per rank for the sliding-window snapshots that make a cached prefix resumable
    # (each `state_size_to_disk` bytes, cache_engine.py:306), least recently used dropped first;
    # a snapshot also goes when its block leaves both tiers.
    snapshot_bytes_per_rank: int = 2 * 1024**3
    write_through: bool = False  # copy committed pages to the host tier at once
    cache_policy: str = "lru"  # [cache] policy: which GPU-tier block goes first (cache/policy.py)
    prefill_watermark: float = 0.9  # the engine stalls prefill admission past this usage
    commit_point: Literal["release", "final_token"] = "release"  # "final_token": the published bug
    # DeepInfer keeps the sliding window only at a sequence's LAST 128 boundary, and a resume must
    # leave KEEP tokens to replay: a prompt's own end is never a resume point. When the best
    # resumable prefix is this many tokens short of P = len - KEEP (rounded down to 128), a one-
    # token priming pass over prompt[:P + 1] runs first: it commits [0, P) with its state, the
    # request then replays only the last KEEP..KEEP+127 tokens, and an identical or slightly
    # longer next prompt resumes at P. 0 = off. Its tokens count as computed, never as cached.
    prime_min_tokens: int = 512
    # Session affinity: a session stays on its rank unless that rank has this many more
    # requests waiting for their prefill than the least queued one (routing.SessionRouter).
    affinity_max_imbalance: int = 8
    idle_wait_s: float = 0.01
    master_addr: str = "127.0.0.1"  # MASTER_ADDR / MASTER_PORT of the ranks' gloo rendezvous
    master_port: int = 29500  # DeepInfer connects to MASTER_PORT - 50 (utils.py:222-230)
    # The code that provides the deepinfer names in each rank process: "deepinfer" (the installed
    # package) or "module:function" returning them (the CPU test harness, see docs/deepinfer.md).
    backend: str = "deepinfer"
    rank_start_timeout_s: float = 600.0
    # A rank silent this long (no step ends, no beat) is hung: its requests fail and the ranks
    # stop, as when one exits (watchdog.py). Far above any one step (a 128K-token prefill chunk).
    hung_rank_s: float = 300.0
    visible_devices: str = ""  # CUDA_VISIBLE_DEVICES; "" = the first data_parallel_size cards
    environment: dict[str, str] = field(default_factory=dict)  # on top of REQUIRED_ENVIRONMENT
    engine_args: dict[str, Any] = field(default_factory=dict)  # extra EngineArgs fields

    def validate(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.max_model_len <= KVSTORE_GRAIN:
            raise ValueError(f"max_model_len must be > {KVSTORE_GRAIN}, got {self.max_model_len}")
        if not 0.0 <= self.gpu_tier_fraction < self.prefill_watermark:
            raise ValueError("gpu_tier_fraction must be in [0, prefill_watermark)")
        for name in ("prefill_attempt_interval", "prefill_any_attempt_interval", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.commit_point not in ("release", "final_token"):
            raise ValueError(f"commit_point must be 'release' or 'final_token', got {self.commit_point!r}")
        make_policy(self.cache_policy)  # raises for an unknown one, naming the known ones
        if not self.hung_rank_s > 0:
            raise ValueError(f"hung_rank_s must be > 0, got {self.hung_rank_s}")
        if not 0.0 < self.prefill_watermark <= 1.0:
            raise ValueError(f"prefill_watermark must be in (0, 1], got {self.prefill_watermark}")
        for name in ("affinity_max_imbalance", "prime_min_tokens", "host_tier_bytes_per_rank",
                     "host_tier_blocks_per_rank", "snapshot_bytes_per_rank"):  # fmt: skip
            if getattr(self, name) < 0:  # a negative imbalance left routing no rank at all
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        given = [d for d in self.visible_devices.split(",") if d.strip()]
        if given and len(given) < self.data_parallel_size:  # two ranks on one card otherwise
            raise ValueError(
                f"visible_devices names {len(given)} GPU(s) for data_parallel_size={self.data_parallel_size}"
            )
        fixed = sorted(k for k in self.environment if k in FIXED_ENVIRONMENT)
        if fixed:
            raise ValueError(
                f"environment may not set {', '.join(fixed)}: the adapter's cache resume depends on "
                "its value (a warm hit would fail inside DeepInfer)"
            )

    @property
    def yoco_keep_tokens(self) -> int:
        return int(self.process_environment(0)["DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"])

    @property
    def extra_state_tokens(self) -> int:
        return int(self.process_environment(0).get("DEEPINFER_PREFILL_STORE_EXTRA_SIZE", "128"))

    def devices(self) -> list[str]:
        given = [d.strip() for d in self.visible_devices.split(",") if d.strip()]
        return given or [str(i) for i in range(self.data_parallel_size)]

    def process_environment(self, rank: int) -> dict[str, str]:
        """Variables set in rank `rank`'s process before deepinfer is imported: one visible GPU
        (each engine uses cuda:0 of its own process) and the rendezvous address."""
        env = dict(REQUIRED_ENVIRONMENT)
        if self.prefill_attempt_interval is not None:
            env["DEEPINFER_PREFILL_ATTEMPT_INTERVAL"] = str(self.prefill_attempt_interval)
        if self.prefill_any_attempt_interval is not None:
            env["DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL"] = str(self.prefill_any_attempt_interval)
        env.update({k: str(v) for k, v in self.environment.items()})
        devices = self.devices()
        env["CUDA_VISIBLE_DEVICES"] = devices[rank % len(devices)]
        env["MASTER_ADDR"] = self.master_addr
        env["MASTER_PORT"] = str(self.master_port)
        return env

    def model_facts(self) -> tuple[tuple[int, ...], int]:
        """EOS ids and vocabulary size: given, or from the model folder's config.json."""
        eos, vocab = self.eos_token_ids, self.vocab_size
        if eos is None or vocab is None:
            path = Path(self.model) / "config.json"
            try:
                cfg = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as err:
                raise ValueError(f"cannot read the model's config.json at {path}: {err}") from None
            raw = cfg.get("eos_token_id")
            eos = eos if eos is not None else tuple(raw if isinstance(raw, list) else [raw])
            vocab = vocab if vocab is not None else int(cfg["vocab_size"])
        return tuple(int(e) for e in eos), int(vocab)

    @classmethod
    def from_profile(cls, profile: Any, model_path: str | None = None) -> DeepInferConfig:
        """From a profile: [model] path / max_num_seqs, context_window, [hardware] cards,
        [cache] host tier and policy knobs, and [deepinfer]'s settings (SCHEDULE_KEYS, WATCH_KEYS)."""
        cache = dict(profile.cache)
        settings = dict(getattr(profile, "deepinfer", {}) or {})
        unknown = sorted(set(settings) - set(SCHEDULE_KEYS) - set(WATCH_KEYS))
        if unknown:
            known = ", ".join(SCHEDULE_KEYS + WATCH_KEYS)
            raise ValueError(f"unknown [deepinfer] keys: {', '.join(unknown)}; known: {known}")
        cards = max(1, int(profile.hardware.get("cards", 1)))
        # host_cache_mb holds the pages and the window snapshots: the snapshots' share first
        # (snapshot_cache_mb; by default an eighth of it, at most DEFAULT_SNAPSHOT_CACHE_MB).
        host_bytes = int(cache.get("host_cache_mb", 0)) * 1024**2
        if "snapshot_cache_mb" in cache:
            snapshot_bytes = int(cache["snapshot_cache_mb"]) * 1024**2
        elif host_bytes:
            snapshot_bytes = min(DEFAULT_SNAPSHOT_CACHE_MB * 1024**2, host_bytes // 8)
        else:
            snapshot_bytes = DEFAULT_SNAPSHOT_CACHE_MB * 1024**2
        if host_bytes:
            snapshot_bytes = min(snapshot_bytes, host_bytes)
            host_bytes -= snapshot_bytes
        return cls(
            model=model_path or profile.model.path,
            data_parallel_size=cards,
            max_model_len=profile.context_window,
            max_num_seqs=profile.model.max_num_seqs,
            served_model=profile.served_model,
            gpu_memory_utilization=float(cache.get("gpu_memory_utilization", 0.9)),
            gpu_tier_fraction=float(cache.get("gpu_tier_fraction", 0.6)),
            cache_policy=str(cache.get("policy", "lru")),
            host_tier_bytes_per_rank=host_bytes // cards,
            snapshot_bytes_per_rank=snapshot_bytes // cards,
            **{key: int(value) for key, value in settings.items() if key in SCHEDULE_KEYS},
            **{key: float(value) for key, value in settings.items() if key in WATCH_KEYS},
        )

    def schedule(self) -> dict[str, int]:
        """The engine's step settings as this adapter runs them (None: DeepInfer's default), for
        the simulator's ikcode rows."""
        values = {key: getattr(self, key) for key in SCHEDULE_KEYS}
        if not self.chunked_prefill:
            values["max_num_batched_tokens"] = None  # a whole prompt per step (config.py:228)
        return {key: value for key, value in values.items() if value is not None}
