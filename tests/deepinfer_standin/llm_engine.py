"""Stand-in for deepinfer.engine.llm_engine.LLMEngine: the slice the ikcode adapter drives.

Mirrors (facts file, deepinfer==0.1.0):
- from_engine_args / EngineArgs defaults (llm_engine.py:460-469, arg_utils.py:21-114);
- add_request(..., enqueue=False) -> Sequence | None (llm_engine.py:471-631);
- the driving loop step / has_unfinished_requests / flush_inflight_reqs (entrypoints/llm.py:176-186);
- outputs released by the NEXT step (pybind_output.cpp:12-35); one output per emitted token;
- zero-overhead scheduling: the final token's output arrives one step after it was sampled, and
  the sequence is freed (free_finished_seqs -> do_save_kvcache -> finalize_seq -> free_seq) only
  at the first DECODE schedule after that; prefill steps collect nothing (scheduler.hpp:549);
- EOS emitted as a token; rejected requests echo the prompt's last token; aborted RUNNING
  requests emit no final output but still reach finalize_seq; aborted WAITING ones do not;
- DP ranks joined by a collective: has_unfinished_requests and step are called in lockstep by
  every rank, idle ones included (config.py:150-182, utils.py:222-230);
- cached-token statistics are always 0 (scheduler.hpp:340, 549, 658).
The "model" is a deterministic function of the KV pages and the sliding-window ring, so a cached
prefix gives the cold answer only if its pages and state were restored exactly.
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass

import numpy as np

from .memory import BLOCK_SIZE, WINDOW, BlockManager, CacheEngine
from .scheduler import Scheduler
from .sequence import RequestOutput, Sequence, SequenceStatus, StandinSamplingParams

EOS_TOKEN_ID = 2
VOCAB_SIZE = 300
COLLECTIVE_TIMEOUT_S = 20.0


@dataclass
class EngineArgs:
    model: str = "standin"
    max_model_len: int = 4096  # the default to watch (arg_utils.py:21-114)
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.9
    chunked_prefill: int = 8192
    data_parallel_size: int = 1
    engine_rank: int = 0
    dist_init_addr: str = "127.0.0.1:29500"  # stand-in name for the gloo rendezvous
    num_gpu_blocks: int = 256  # stand-in only: the real engine sizes this from memory


class _DPGroup:
    """What gloo gives the ranks: a barrier per collective (config.py:150-182)."""

    _groups: dict[str, _DPGroup] = {}
    _lock = threading.Lock()

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=COLLECTIVE_TIMEOUT_S)
        self.flags = [False] * size

    @classmethod
    def join(cls, addr: str, size: int) -> _DPGroup:
        with cls._lock:
            group = cls._groups.get(addr)
            if group is None or group.size != size or group.barrier.broken:
                group = cls._groups[addr] = _DPGroup(size)
            return group

    def all_reduce_or(self, rank: int, value: bool) -> bool:
        self.flags[rank] = value
        self._wait()
        result = any(self.flags)
        self._wait()
        return result

    def _wait(self) -> None:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise RuntimeError("DP ranks out of lockstep: a rank did not join the collective") from None


class LLMEngine:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.blocks = BlockManager(args.num_gpu_blocks)
        self.cache_engine = CacheEngine(args.num_gpu_blocks, args.max_num_seqs)
        states = self.cache_engine.gpu_states
        self.scheduler = Scheduler(self.blocks, states, args.max_num_seqs, args.chunked_prefill)
        self.group = _DPGroup.join(args.dist_init_addr, args.data_parallel_size)
        self.rank = args.engine_rank
        self._inflight: list[tuple[Sequence, int]] = []
        self._rejected: list[RequestOutput] = []
        self._last_outputs: list[RequestOutput] = []
        self._by_id: dict[str, Sequence] = {}
        self.num_steps = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, user_id, request_id, sampling_params, prompt_token_ids, enqueue=True):
        prompt = np.asarray(prompt_token_ids)
        assert prompt.dtype == np.int32 and prompt.ndim == 1, "prompt_token_ids must be np.int32[1-D]"
        if prompt.shape[0] >= self.args.max_model_len:
            # Rejected: the output echoes the prompt's last token (facts: gaps the server fills).
            last = int(prompt[-1])
            reject = self._output(request_id, len(prompt), last, "prompt_length_exceeded", True, 0)
            self._rejected.append(reject)
            return None
        seq = Sequence(user_id, request_id, sampling_params, prompt)
        self._by_id[request_id] = seq
        if enqueue:
            raise NotImplementedError("the stand-in covers the enqueue=False path the adapter uses")
        return seq

    def abort_request(self, request_id: str) -> None:
        seq = self._by_id.get(request_id)
        if seq is None or seq.status in (SequenceStatus.FINISHED, SequenceStatus.FREED):
            return
        seq.aborted = True
        seq.finish_reason = "abort"
        if seq.status is SequenceStatus.WAITING:
            # Never reaches finalize_seq: whatever the caller pre-allocated is the caller's to free.
            if seq in self.scheduler.waiting:
                self.scheduler.waiting.remove(seq)
            del self._by_id[request_id]
            return
        self._close(seq)  # RUNNING: no final output, freed at the next decode schedule

    # ---- the loop -------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        s = self.scheduler
        local = bool(s.waiting or s.running or self._inflight or self._rejected)
        return self.group.all_reduce_or(self.rank, local) if self.group.size > 1 else local

    def step(self) -> list[RequestOutput]:
        self._release_outputs()
        self.num_steps += 1
        if self.group.size > 1:
            self.group._wait()  # the forward's collectives: every rank steps, idle ones too
        inflight, self._inflight = self._inflight, []
        kind, scheduled = self.scheduler.schedule()
        if kind == "decode":
            self._free_finished_seqs(scheduled)
        for seq, n in scheduled:
            self._forward(seq, n)
        return self._post_process(inflight)

    def flush_inflight_reqs(self) -> list[RequestOutput]:
        self._release_outputs()
        inflight, self._inflight = self._inflight, []
        outs = self._post_process(inflight)
        self._free_finished_seqs([])
        return outs

    # ---- hooks of the withheld cache system (llm_engine.py:787-858) -----------------------------
    def do_save_kvcache(self, scheduled, finished) -> None:
        pass

    def finalize_seq(self, seq: Sequence) -> None:
        self.scheduler.free_seq(seq)
        self._by_id.pop(seq.request_id, None)

    # ---- internals ------------------------------------------------------------------------------
    def _free_finished_seqs(self, scheduled) -> None:
        finished = self.scheduler.finished()
        if finished:
            self.do_save_kvcache(scheduled, finished)
            for seq in finished:
                self.finalize_seq(seq)

    def _forward(self, seq: Sequence, n: int) -> None:
        mem = self.cache_engine.gpu_cache[0]
        states = self.cache_engine.gpu_states
        start = seq.num_written
        end = min(len(seq.token_ids), start + n)
        for pos in range(start, end):
            block_index = pos // BLOCK_SIZE
            if block_index == len(seq._blocks):
                seq._blocks.append(self.blocks.allocate())  # decode growth
            mem[seq._blocks[block_index], pos % BLOCK_SIZE] = seq.token_ids[pos]
        if end > start:
            before = states.ring[seq.state_id].copy()
            kept = states.boundary_rings[seq.state_id]
            last = end // BLOCK_SIZE * BLOCK_SIZE
            if last > start:
                # DEEPINFER_PREFILL_STORE_EXTRA_STATE=1 keeps the window at the LAST 128 boundary
                # (facts: "What a resumed prefix needs"); earlier ones are overwritten.
                recent = np.asarray(seq.token_ids[max(start, last - WINDOW) : last], dtype=np.int64)
                kept.clear()
                kept[last] = np.concatenate([before, recent])[-WINDOW:]
            recent = np.asarray(seq.token_ids[max(start, end - WINDOW) : end], dtype=np.int64)
            states.ring[seq.state_id] = np.concatenate([before, recent])[-WINDOW:]
        seq.num_written = end
        seq.num_cached_tokens = end
        if end == len(seq.token_ids):
            token = self._model(seq)
            seq.token_ids.append(token)
            self._inflight.append((seq, token))

    def _model(self, seq: Sequence) -> int:
        """Next token: a hash of every KV page position and the ring (greedy, deterministic)."""
        mem = self.cache_engine.gpu_cache[0]
        n = seq.num_written
        kv = mem[seq._blocks].reshape(-1)[:n]
        h = zlib.crc32(kv.tobytes())
        h = zlib.crc32(self.cache_engine.gpu_states.ring[seq.state_id].tobytes(), h)
        return EOS_TOKEN_ID if h % 100 == 0 else 3 + h % (VOCAB_SIZE - 3)

    def _post_process(self, inflight: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        outs, self._rejected = self._rejected, []
        for seq, token in inflight:
            if seq.status is not SequenceStatus.RUNNING or seq.aborted:
                continue
            reason = None
            if token == EOS_TOKEN_ID:
                reason = "stop"  # EOS is emitted as a token
            elif seq.num_output_tokens - self._unreported(seq) >= seq.sampling_params.max_tokens:
                reason = "length"
            elif len(seq.token_ids) - self._unreported(seq) >= self.args.max_model_len:
                reason = "length"
            done = reason is not None
            outs.append(
                self._output(seq.request_id, seq.prompt_len, token, reason, done,
                             seq.num_output_tokens - self._unreported(seq))
            )  # fmt: skip
            if done:
                seq.finish_reason = reason
                self._close(seq)
        self._last_outputs = list(outs)
        return outs

    def _unreported(self, seq: Sequence) -> int:
        return sum(1 for s, _ in self._inflight if s is seq)

    def _close(self, seq: Sequence) -> None:
        """FINISHED: drop the speculative sample of this step; valid KV covers len - 1 tokens."""
        extra = self._unreported(seq)
        self._inflight = [(s, t) for s, t in self._inflight if s is not seq]
        if extra:
            del seq.token_ids[-extra:]
        seq.status = SequenceStatus.FINISHED
        seq.num_cached_tokens = min(seq.num_written, len(seq.token_ids) - 1)

    def _output(self, request_id, prompt_len, token_id, finish_reason, finished, num_output_tokens):
        return RequestOutput(
            request_id=request_id, prompt_len=prompt_len, token_id=token_id,
            finish_reason=finish_reason, finished=finished, num_output_tokens=num_output_tokens,
        )  # fmt: skip

    def _release_outputs(self) -> None:
        for out in self._last_outputs:
            out.release()
        self._last_outputs = []


SamplingParams = StandinSamplingParams
