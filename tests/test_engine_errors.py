"""Bad input is refused with typed errors and numbers; aborts and failures end the request, free its
blocks, and the engine keeps serving."""

from __future__ import annotations

import pytest
import torch

import ikcode.engines.embedded.engine as engine_module
from ikcode.cache import hash_blocks
from ikcode.engines.base import (
    EmptyPrompt,
    EngineError,
    EngineRequest,
    EngineShutdown,
    FinishReason,
    InvalidSampling,
    LifecycleKind,
    PromptTooLong,
    SamplingParams,
    TokenOutOfVocab,
)
from tests.tiny_model import TINY_VOCAB, assert_pool_clean, tiny_engine, wait_idle

OK = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture
def engine():
    e = tiny_engine(kv_memory_bytes=1 << 20)
    yield e
    e.shutdown(drain_timeout_s=5)


def _serves(engine) -> None:
    tokens, final = engine.submit(EngineRequest(f"ok{engine.steps}", [5, 6, 7], OK)).collect(30)
    assert len(tokens) == 4 and final.error is None
    assert_pool_clean(engine)


def test_bad_input_is_typed_with_numbers(engine):
    window = engine.info.context_window
    with pytest.raises(PromptTooLong) as too_long:
        engine.submit(EngineRequest("long", [5] * (window + 10), OK))
    assert too_long.value.prompt_tokens == window + 10 and too_long.value.max_tokens == window - 1
    assert "prompt is too long" in str(too_long.value)
    with pytest.raises(EmptyPrompt):
        engine.submit(EngineRequest("empty", [], OK))
    with pytest.raises(TokenOutOfVocab) as oov:
        engine.submit(EngineRequest("oov", [5, 6, TINY_VOCAB + 3, 7], OK))
    assert (oov.value.token_id, oov.value.vocab_size, oov.value.position) == (TINY_VOCAB + 3, TINY_VOCAB, 2)
    with pytest.raises(TokenOutOfVocab):
        engine.submit(EngineRequest("neg", [-1], OK))
    with pytest.raises(InvalidSampling):
        engine.submit(EngineRequest("zero", [5], SamplingParams(max_tokens=0)))
    with pytest.raises(InvalidSampling):
        engine.submit(EngineRequest("topp", [5], SamplingParams(top_p=0.0)))
    _serves(engine)


def test_duplicate_request_id_is_refused(engine):
    engine.submit(EngineRequest("dup", [5] * 50, SamplingParams(max_tokens=200, ignore_eos=True)))
    with pytest.raises(EngineError):
        engine.submit(EngineRequest("dup", [5], OK))
    engine.abort("dup")
    _serves(engine)


def test_abort_waiting_and_running():
    engine = tiny_engine(start=False, kv_memory_bytes=1 << 20)
    waiting = engine.submit(EngineRequest("w", [5] * 20, OK))
    waiting.abort()
    engine.start()
    tokens, final = waiting.collect(10)
    assert final.finish_reason is FinishReason.ABORT and tokens == []

    running = engine.submit(EngineRequest("r", [6] * 300, SamplingParams(max_tokens=100000, ignore_eos=True)))
    first = next(iter(running))
    assert first.token_ids
    running.abort()
    _, final = running.collect(10)
    assert final.finish_reason is FinishReason.ABORT
    engine.abort("r")  # after the end: a no-op
    engine.abort("nobody")
    _serves(engine)
    engine.shutdown()


def test_forward_failure_fails_only_that_step_and_frees_blocks(engine, monkeypatch):
    real_run = engine.runner.run
    calls = {"n": 0}

    def flaky(scheduled):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated kernel failure")
        return real_run(scheduled)

    monkeypatch.setattr(engine.runner, "run", flaky)
    tokens, final = engine.submit(EngineRequest("boom", [5] * 40, SamplingParams(max_tokens=50))).collect(30)
    assert final.finish_reason is FinishReason.ERROR and isinstance(final.error, EngineError)
    assert "simulated kernel failure" in str(final.error)
    _serves(engine)


def test_sampling_failure_fails_only_that_request(engine, monkeypatch):
    # A step's rows are sampled at once; when that raises, the engine samples them one by one, so
    # only the request whose sampling fails is failed.
    real_rows, real_sample = engine_module.sample_rows, engine_module.sample

    def picky_rows(logits, params, generators, token_ids):
        if any(p.seed == 666 for p in params):
            raise ValueError("bad sampler state")
        return real_rows(logits, params, generators, token_ids)

    def picky(logits, params, generator, token_ids=()):
        if params.seed == 666:
            raise ValueError("bad sampler state")
        return real_sample(logits, params, generator, token_ids)

    monkeypatch.setattr(engine_module, "sample_rows", picky_rows)
    monkeypatch.setattr(engine_module, "sample", picky)
    bad = engine.submit(EngineRequest("bad", [5] * 30, SamplingParams(max_tokens=5, seed=666)))
    good = engine.submit(EngineRequest("good", [6] * 30, OK))
    assert bad.collect(30)[1].finish_reason is FinishReason.ERROR
    tokens, final = good.collect(30)
    assert final.finish_reason is FinishReason.LENGTH and len(tokens) == 4
    _serves(engine)


def test_a_seeded_request_draws_the_same_tokens_when_its_step_falls_back_to_one_by_one(engine, monkeypatch):
    # The fallback restores each generator's state from before the batched attempt: a seeded
    # request next to one whose sampling fails gets the tokens it gets alone.
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=7, ignore_eos=True)
    alone, _ = engine.submit(EngineRequest("alone", [6] * 30, params, cache_salt="a")).collect(30)
    real_rows = engine_module.sample_rows

    def draws_then_fails(logits, params_list, generators, token_ids):
        real_rows(logits, params_list, generators, token_ids)  # every generator advances
        raise ValueError("failed after drawing")

    monkeypatch.setattr(engine_module, "sample_rows", draws_then_fails)
    tokens, final = engine.submit(EngineRequest("again", [6] * 30, params, cache_salt="b")).collect(30)
    assert final.error is None and tokens == alone
    _serves(engine)


def test_shutdown_drains_then_refuses():
    engine = tiny_engine(kv_memory_bytes=1 << 20)
    stream = engine.submit(EngineRequest("d", [5] * 30, OK))
    engine.shutdown(drain_timeout_s=10)
    tokens, final = stream.collect(5)
    assert final.finish_reason is FinishReason.LENGTH and len(tokens) == 4
    with pytest.raises(EngineShutdown):
        engine.submit(EngineRequest("late", [5], OK))
    engine.cache.check_invariants()
    assert engine.cache.num_free_blocks() == engine.num_blocks


def test_a_submit_that_lands_after_the_last_step_is_still_ended_at_shutdown():
    # A submit can pass its shutdown check, then reach the scheduler after the engine thread's
    # last step; the final abort pass must still end that stream, or its reader waits forever.
    engine = tiny_engine(kv_memory_bytes=1 << 20, start=False)
    stream = engine.submit(EngineRequest("late", [5] * 30, OK))
    engine._abort_everything()  # what the engine thread runs last, with "late" never stepped
    _, final = stream.collect(5)
    assert final.finish_reason is FinishReason.ABORT and isinstance(final.error, EngineShutdown)
    assert engine.idle()


# ---- a failed tier copy fails one request, never the engine ------------------------------------
def _fail_once(monkeypatch, engine, name: str) -> dict:
    """Make the runner's next `name` copy (copy_device_to_host / copy_host_to_device) raise."""
    real = getattr(engine.runner, name)
    left = {"failures": 1}

    def flaky(pairs):
        if left["failures"]:
            left["failures"] -= 1
            raise RuntimeError(f"injected {name} failure")
        return real(pairs)

    monkeypatch.setattr(engine.runner, name, flaky)
    return left


def test_a_failed_write_through_at_release_leaves_the_engine_serving(monkeypatch):
    """The copy fails after the cache let go of the sequence: the scheduler must forget it too
    (it was released again every step, failing every later request)."""
    engine = tiny_engine(kv_memory_bytes=64 * 1024, host_kv_memory_bytes=64 * 1024, host_write_through=True)
    try:
        left = _fail_once(monkeypatch, engine, "copy_device_to_host")
        tokens, final = engine.submit(EngineRequest("a", list(range(3, 43)), OK)).collect(30)
        assert len(tokens) == 4 and final.error is None
        wait_idle(engine)  # the release (and its copy) comes after the final token
        assert left["failures"] == 0
        _serves(engine)
        assert not engine.scheduler.seqs
    finally:
        engine.shutdown(drain_timeout_s=5)


def test_a_failed_promotion_computes_the_prefix_instead(monkeypatch):
    """The copy from the host tier fails: the request is served all the same, its prefix computed
    (it failed, and with a copy that keeps failing, every later turn of the conversation did)."""
    engine = tiny_engine(start=False, kv_memory_bytes=128 * 1024, host_kv_memory_bytes=64 * 1024)
    prompt = list(range(3, 63))

    def run_until_idle():
        while not engine.idle():
            engine.step()

    try:
        engine.submit(EngineRequest("first", prompt, SamplingParams(max_tokens=1)))
        run_until_idle()
        for i in range(20):  # other prompts push this one's blocks out to the host tier
            if engine.cache.match(hash_blocks(prompt, engine.info.block_size)).device_blocks == 0:
                break
            other = [3 + (i * 37 + j) % 290 for j in range(20)]
            engine.submit(EngineRequest(f"flush{i}", other, SamplingParams(max_tokens=1)))
            run_until_idle()
        assert engine.cache.match(hash_blocks(prompt, engine.info.block_size)).host_blocks > 0
        left = _fail_once(monkeypatch, engine, "copy_host_to_device")
        long = SamplingParams(max_tokens=40, ignore_eos=True)
        bystander = engine.submit(EngineRequest("bystander", [5, 6, 7], long))
        for _ in range(3):
            engine.step()
        again = engine.submit(EngineRequest("again", prompt, SamplingParams(max_tokens=3)))
        engine.start()
        tokens, final = bystander.collect(30)
        assert len(tokens) == 40 and final.error is None  # it ran on, untouched
        tokens, served = again.collect(30)
        assert left["failures"] == 0 and served.error is None and len(tokens) >= 1
        assert served.stats.cached_tokens_host == 0 and served.stats.computed_tokens > 0
        wait_idle(engine)
        assert_pool_clean(engine)
        _serves(engine)
    finally:
        engine.shutdown(drain_timeout_s=5)


def test_a_forward_failure_fails_only_the_request_that_causes_it():
    """A batch whose forward raises (one request's bad chunk) runs again one request at a time:
    the others in it finish as if nothing happened."""
    engine = tiny_engine(start=False, kv_memory_bytes=1 << 20)
    real_forward = engine.runner.model.forward

    def forward(batch, k_pools, v_pools):
        if bool(batch.input_ids.eq(TINY_VOCAB - 1).any()):
            raise RuntimeError("injected failure of one request's rows")
        return real_forward(batch, k_pools, v_pools)

    engine.runner.model.forward = forward
    try:
        long = SamplingParams(max_tokens=10, ignore_eos=True)
        good = [engine.submit(EngineRequest(f"g{i}", [5 + i] * 30, long)) for i in range(3)]
        bad = engine.submit(EngineRequest("bad", [5] * 20 + [TINY_VOCAB - 1], long))
        engine.start()  # all four share the first steps
        for stream in good:
            tokens, final = stream.collect(30)
            assert len(tokens) == 10 and final.error is None, final.error
        _, failed = bad.collect(30)
        assert failed.finish_reason is FinishReason.ERROR and "injected failure" in str(failed.error)
        wait_idle(engine)
        assert_pool_clean(engine)
        _serves(engine)
    finally:
        engine.shutdown(drain_timeout_s=5)


def test_a_finished_request_whose_blocks_cannot_be_committed_is_released_all_the_same(engine, monkeypatch):
    """It stayed due for release, failing again every step: every later request failed with it."""
    real = engine.blocks_to_commit

    def blocks_to_commit(seq):
        if seq.seq_id == "x":
            raise ValueError("injected hashing failure")
        return real(seq)

    monkeypatch.setattr(engine, "blocks_to_commit", blocks_to_commit)
    tokens, final = engine.submit(EngineRequest("x", list(range(3, 43)), OK)).collect(30)
    assert len(tokens) == 4 and final.error is None
    for _ in range(3):
        _serves(engine)
    wait_idle(engine)
    assert not engine.scheduler.seqs
    assert_pool_clean(engine)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_engine_thread_that_stops_ends_its_streams_and_refuses_new_work():
    """Whatever ends the thread (here a listener raising SystemExit, which `except Exception` lets
    through), no stream is left waiting and a later submit is refused, not queued for ever."""
    engine = tiny_engine(kv_memory_bytes=1 << 20)

    def listener(event):
        if event.kind is LifecycleKind.ADMITTED and event.request_id == "x":
            raise SystemExit("injected")

    engine.add_listener(listener)
    try:
        _, final = engine.submit(EngineRequest("x", [5, 6, 7], OK)).collect(30)
        assert final.error is not None
        engine._thread.join(timeout=30)  # noqa: SLF001
        with pytest.raises(EngineShutdown):
            engine.submit(EngineRequest("y", [5, 6, 7], OK))
    finally:
        engine.shutdown(drain_timeout_s=5)


def test_rope_tables_cover_the_window_the_pool_can_hold_not_the_files_context_length():
    """A model file's context_length sized them: 1M positions cost GBs for a window the pool
    could never reach, and a corrupt 2**28 failed the start."""
    import dataclasses

    from ikcode.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from tests.tiny_model import tiny_config, tiny_state_dict

    cfg = dataclasses.replace(tiny_config("llama", False), max_position_embeddings=1 << 16)
    config = EmbeddedEngineConfig(kv_memory_bytes=256 * 1024, num_threads=1, device="cpu")
    engine = EmbeddedEngine(cfg, tiny_state_dict(cfg, 0), config)
    try:
        assert engine.context_window < 1 << 16
        assert engine.runner.model.rope_cos.shape[0] == engine.context_window
        engine.start()
        _serves(engine)
    finally:
        engine.shutdown(drain_timeout_s=5)


def test_every_engine_error_survives_the_pipe_from_a_rank():
    """A DeepInfer rank pickles the error that ends a request; pickle rebuilds an exception as
    cls(*args), which EngineShutdown() refused, and the exception killed the gateway's reader
    thread at each shutdown with a live request."""
    import pickle

    from ikcode.engines import errors

    samples = [
        EngineError("x"),
        PromptTooLong(9000, 8192),
        EmptyPrompt(),
        TokenOutOfVocab(70000, 65536, 3),
        InvalidSampling("max_tokens must be > 0"),
        errors.EngineOverloaded("no KV memory", retry_after_s=7),
        EngineShutdown(),
    ]
    defined = {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, EngineError)}
    assert defined == {type(s) for s in samples}  # a new error class needs a sample here
    for sample in samples:
        back = pickle.loads(pickle.dumps(sample))
        assert type(back) is type(sample) and str(back) == str(sample)
        assert vars(back) == vars(sample)
