"""The stand-in reproduces the DeepInfer contract the adapter depends on (facts: deepinfer.md).
If one of these fails, the adapter tests prove nothing."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests import deepinfer_standin as di
from tests.deepinfer_standin import llm_engine
from tests.deepinfer_standin.harness import random_tokens


class Recording(di.LLMEngine):
    def __init__(self, args):
        super().__init__(args)
        self.finalized: list[tuple[str, int]] = []

    def finalize_seq(self, seq):
        self.finalized.append((seq.request_id, self.num_steps))
        super().finalize_seq(seq)


def engine(**kw) -> Recording:
    kw.setdefault("dist_init_addr", f"single-{id(kw)}")
    args = di.EngineArgs(max_model_len=4096, max_num_seqs=4, num_gpu_blocks=64, **kw)
    return Recording.from_engine_args(args)


def new_seq(e, rid: str, prompt: list[int], max_tokens: int = 16):
    params = di.SamplingParams(max_tokens=max_tokens)
    return e.add_request("u", rid, params, np.asarray(prompt, np.int32), enqueue=False)


def add(e, rid: str, prompt: list[int], max_tokens: int = 16):
    seq = new_seq(e, rid, prompt, max_tokens)
    assert e.scheduler.try_allocate_seq(seq)
    e.scheduler.add_sequence(seq)
    return seq


def drive(e, steps: int):
    out = []
    for _ in range(steps):
        outs = e.step() if e.has_unfinished_requests() else e.flush_inflight_reqs()
        out.append([(o.request_id, o.token_id, o.finish_reason, o.finished) for o in outs])
    return out


def test_finished_comes_steps_before_finalize_seq():
    e = engine()
    add(e, "a", random_tokens(300, 1), max_tokens=4)
    steps = drive(e, 12)
    done_at = next(i + 1 for i, outs in enumerate(steps) if any(f for *_, f in outs))
    ((rid, freed_at),) = e.finalized
    assert rid == "a" and freed_at >= done_at + 1  # one or more steps later, at a decode schedule


def test_prefill_steps_delay_the_free():
    e = engine(chunked_prefill=128)
    add(e, "a", random_tokens(200, 1), max_tokens=2)
    steps = drive(e, 4)
    done_at = next(i + 1 for i, outs in enumerate(steps) if any(f for *_, f in outs))
    add(e, "b", random_tokens(1000, 2), max_tokens=2)  # 8 prefill steps of 128 tokens
    drive(e, 20)
    freed_a = dict(e.finalized)["a"]
    assert freed_a >= done_at + 8, (done_at, freed_a)


def test_outputs_are_released_by_the_next_step():
    e = engine()
    add(e, "a", random_tokens(100, 1))
    outs = []
    while not outs:
        outs = e.step()
    kept, copy = outs[0], di.RequestOutput.clone(outs[0])
    e.step()
    with pytest.raises(RuntimeError):
        _ = kept.token_id
    assert copy.token_id >= 0


def test_eos_is_emitted_as_a_token_and_rejections_echo_the_last_prompt_token():
    e = engine()
    assert e.add_request("u", "r", di.SamplingParams(), np.arange(4096, dtype=np.int32) % 200 + 3) is None
    ((rid, token, reason, finished),) = drive(e, 1)[0]
    assert (rid, token, reason, finished) == ("r", (4095 % 200) + 3, "prompt_length_exceeded", True)
    eos = []
    for batch in range(50):  # some reply hits EOS within 16 tokens (1 in 100 per token)
        for i in range(4):
            add(e, f"s{batch}-{i}", random_tokens(130, batch * 4 + i))
        outs = [o for step in drive(e, 24) for o in step]
        eos += [o for o in outs if o[1] == di.EOS_TOKEN_ID]
        if eos:
            break
    assert eos and all(o[2] == "stop" and o[3] for o in eos)


def test_aborted_running_gets_no_final_output_and_waiting_is_not_finalized():
    e = engine(chunked_prefill=128)
    add(e, "run", random_tokens(130, 1), max_tokens=100)
    drive(e, 3)
    waiting = add(e, "wait", random_tokens(2000, 2))  # behind a long prefill below
    add(e, "long", random_tokens(2000, 3))
    e.abort_request("run")
    e.abort_request("wait")
    outs = [o for step in drive(e, 40) for o in step if o[0] == "run"]
    assert not any(o[3] for o in outs)  # no final output for the aborted running request
    finalized = [rid for rid, _ in e.finalized]
    assert "run" in finalized and "wait" not in finalized
    assert waiting.block_table  # still holds its blocks: the caller frees them
    e.scheduler.free_seq(waiting)


def test_blocks_state_slots_pins_and_the_watermark():
    e = engine()
    assert 0 not in e.blocks.free  # block 0 reserved
    assert e.cache_engine.gpu_states.num_slots == 4  # 1.2 x max_num_seqs
    seqs = [add(e, f"s{i}", random_tokens(130, i)) for i in range(4)]
    extra = new_seq(e, "x", random_tokens(130, 9))
    assert not e.scheduler.try_allocate_seq(extra)  # no state slot left
    for s in seqs:
        e.abort_request(s.request_id)
        e.scheduler.free_seq(s)
    # Pin past 90%: an allocated request is never prefilled.
    pinned = [e.blocks.allocate() for _ in range(58)]
    stalled = add(e, "stalled", random_tokens(130, 5))
    drive(e, 5)
    assert stalled.status is di.SequenceStatus.WAITING
    e.scheduler.unpin_blocks(pinned)
    drive(e, 2)
    assert stalled.status is di.SequenceStatus.RUNNING


def test_resume_needs_the_yoco_back_off_and_the_state_environment(monkeypatch):
    e = engine()
    seq = new_seq(e, "r", random_tokens(300, 1))
    assert e.scheduler.try_allocate_seq(seq)
    seq.num_cached_tokens = 256  # 300 - 256 < KEEP (140)
    with pytest.raises(AssertionError):
        e.scheduler.add_sequence(seq)
    monkeypatch.delenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", raising=False)
    with pytest.raises(AssertionError):
        e.cache_engine.load_state_from_store_to_prefill_cache(seq.state_id, 128, np.zeros(64), None)
    assert not hasattr(type(seq), "missing") and seq.block_table  # the patched binding is readable
    monkeypatch.setattr(di.Sequence, "block_table_bound", False)
    assert not hasattr(seq, "block_table")


def test_ranks_must_step_in_lockstep(monkeypatch):
    monkeypatch.setattr(llm_engine, "COLLECTIVE_TIMEOUT_S", 0.3)
    a = Recording(di.EngineArgs(data_parallel_size=2, engine_rank=0, dist_init_addr="lockstep"))
    b = Recording(di.EngineArgs(data_parallel_size=2, engine_rank=1, dist_init_addr="lockstep"))
    t = threading.Thread(target=lambda: (b.has_unfinished_requests(), b.step()))
    t.start()
    assert a.has_unfinished_requests() is False and a.step() == []  # together: fine
    t.join()
    with pytest.raises(RuntimeError, match="lockstep"):
        a.step()  # rank 1 does not come
