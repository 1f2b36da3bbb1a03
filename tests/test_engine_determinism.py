"""Temperature 0 gives the same tokens whatever else is in the batch and wherever the prefix came
from (cache or computed), on the tiny model with chunked prefill."""

from __future__ import annotations

import random

import pytest
import torch

from ikcode.engines.base import EngineRequest, LifecycleKind, SamplingParams
from ikcode.engines.embedded import EmbeddedEngine
from tests.tiny_model import assert_pool_clean, tiny_engine

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def record_kv(engine: EmbeddedEngine) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """K/V of every valid token of each finished request, taken before its blocks go back.

    Stronger than comparing tokens: equal tokens could hide last-bit differences, equal K/V cannot.
    """
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    runner, bs = engine.runner, engine.config.block_size

    def on_event(event) -> None:
        if event.kind is LifecycleKind.FINISHED and event.stats.output_tokens > 0:
            table = torch.tensor(engine.cache.block_table(event.request_id))
            valid = event.stats.prompt_tokens + event.stats.output_tokens - 1
            k = runner.k_pool[:, table].flatten(1, 2)[:, :valid].clone()
            v = runner.v_pool[:, table].flatten(1, 2)[:, :valid].clone()
            seen[event.request_id] = (k, v)
            assert valid <= len(table) * bs

    engine.add_listener(on_event)
    return seen


def _same_kv(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 300) for _ in range(n)]


@pytest.mark.parametrize("float_weights", ["fp32", "bf16"])
def test_batched_equals_one_at_a_time(float_weights: str):
    rng = random.Random(1)
    prompts = [_prompt(rng, rng.randrange(5, 150)) for _ in range(8)]
    alone = tiny_engine(float_weights=float_weights)
    kv_alone = record_kv(alone)
    expected = [alone.submit(EngineRequest(f"a{i}", p, GREEDY)).collect(30)[0] for i, p in enumerate(prompts)]
    alone.shutdown()

    batched = tiny_engine(
        start=False,
        max_num_seqs=8,
        max_prefill_tokens_per_step=96,
        kv_memory_bytes=1 << 20,
        float_weights=float_weights,
    )
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[float_weights]
    assert batched.runner.model.layers[0].qkv_weight_t.dtype == dtype
    kv_batched = record_kv(batched)
    streams = [batched.submit(EngineRequest(f"b{i}", p, GREEDY)) for i, p in enumerate(prompts)]
    batched.start()
    got = [s.collect(30)[0] for s in streams]
    assert max(batched.batch_sizes) >= 4  # they really ran together
    assert got == expected
    for i in range(len(prompts)):
        assert _same_kv(kv_alone[f"a{i}"], kv_batched[f"b{i}"]), f"request {i}: K/V differ in the last bits"
    assert_pool_clean(batched)
    batched.shutdown()


@pytest.mark.parametrize(
    ("architecture", "float_weights"), [("llama", "fp32"), ("qwen2", "fp32"), ("llama", "bf16")]
)
def test_cached_prefix_equals_cold(architecture: str, float_weights: str):
    rng = random.Random(7 if architecture == "llama" else 8)
    engine = tiny_engine(
        architecture, start=False, kv_memory_bytes=1024 * 1024, max_num_seqs=6, float_weights=float_weights
    )
    kv = record_kv(engine)
    engine.start()
    warm_hits = 0
    for trial in range(25):
        prompt = _prompt(rng, rng.randrange(20, 300))
        split = rng.randrange(1, len(prompt))
        engine.config.max_prefill_tokens_per_step = rng.choice([16, 37, 64, 512])
        # Cold: a salt nobody else uses, so nothing is served from the cache.
        cold, _ = engine.submit(
            EngineRequest(f"cold{trial}", prompt, GREEDY, cache_salt=f"c{trial}")
        ).collect(30)
        # Seed the cache with the prefix (plus a different tail), then ask for the prompt with
        # unrelated requests in the same batch.
        seed = prompt[:split] + _prompt(rng, rng.randrange(0, 20))
        engine.submit(EngineRequest(f"seed{trial}", seed, SamplingParams(max_tokens=3))).collect(30)
        assert_pool_clean(engine)
        others = [
            engine.submit(EngineRequest(f"o{trial}.{j}", _prompt(rng, rng.randrange(1, 120)), GREEDY))
            for j in range(rng.randrange(0, 3))
        ]
        stream = engine.submit(EngineRequest(f"warm{trial}", prompt, GREEDY))
        warm, final = stream.collect(30)
        for o in others:
            o.collect(30)
        assert final.stats.cached_tokens_device == (split // 16) * 16 or split >= len(prompt) - 1
        warm_hits += final.stats.cached_tokens_device > 0
        assert warm == cold, f"trial {trial}: split {split} of {len(prompt)}"
        assert _same_kv(kv[f"warm{trial}"], kv[f"cold{trial}"]), f"trial {trial}: K/V differ in the last bits"
    assert warm_hits >= 15
    assert_pool_clean(engine)
    engine.shutdown()


def test_seeded_sampling_is_reproducible_and_batch_independent():
    rng = random.Random(3)
    prompt = _prompt(rng, 40)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    engine = tiny_engine(batch_invariance="all")  # sampled, yet batch-independent
    first, _ = engine.submit(EngineRequest("s1", prompt, params)).collect(30)
    noise = engine.submit(EngineRequest("noise", _prompt(rng, 80), params))
    second, _ = engine.submit(EngineRequest("s2", prompt, params)).collect(30)
    noise.collect(30)
    other, _ = engine.submit(
        EngineRequest("s3", prompt, SamplingParams(**{**params.__dict__, "seed": 99}))
    ).collect(30)
    assert first == second
    assert other != first
    engine.shutdown()


def test_greedy_requests_stay_invariant_beside_sampled_ones():
    """The default mode: sampled requests share matmuls and one decode attention call, and the
    greedy ones beside them still get the numbers they get alone."""
    rng = random.Random(5)
    prompts = [_prompt(rng, rng.randrange(5, 150)) for _ in range(4)]
    alone = tiny_engine()
    kv_alone = record_kv(alone)
    expected = [alone.submit(EngineRequest(f"a{i}", p, GREEDY)).collect(30)[0] for i, p in enumerate(prompts)]
    alone.shutdown()

    mixed = tiny_engine(start=False, max_num_seqs=8, max_prefill_tokens_per_step=96, kv_memory_bytes=1 << 20)
    kv_mixed = record_kv(mixed)
    sampled = SamplingParams(temperature=1.0, max_tokens=20, seed=7, ignore_eos=True)
    streams = []
    for i, p in enumerate(prompts):
        streams.append(mixed.submit(EngineRequest(f"g{i}", p, GREEDY)))
        mixed.submit(EngineRequest(f"s{i}", _prompt(rng, rng.randrange(5, 150)), sampled))
    mixed.start()
    assert [s.collect(30)[0] for s in streams] == expected
    assert max(mixed.batch_sizes) == 8
    for i in range(len(prompts)):
        assert _same_kv(kv_alone[f"a{i}"], kv_mixed[f"g{i}"]), f"request {i}: K/V differ in the last bits"
    assert_pool_clean(mixed)
    mixed.shutdown()


def test_shared_decode_attention_matches_alone():
    """batch_invariance="off": decode rows of different lengths in one matmul and one padded
    attention call give what each gives alone, up to rounding (a padding key that leaked into
    the softmax, or a row reading another sequence's keys, would be far off)."""
    rng = random.Random(9)
    prompts = [_prompt(rng, n) for n in (3, 40, 17, 130, 64, 90)]
    alone = tiny_engine(batch_invariance="off")
    kv_alone = record_kv(alone)
    expected = [alone.submit(EngineRequest(f"a{i}", p, GREEDY)).collect(30)[0] for i, p in enumerate(prompts)]
    alone.shutdown()

    batched = tiny_engine(
        batch_invariance="off", start=False, max_num_seqs=8, max_prefill_tokens_per_step=512
    )
    kv_batched = record_kv(batched)
    streams = [batched.submit(EngineRequest(f"b{i}", p, GREEDY)) for i, p in enumerate(prompts)]
    batched.start()
    assert [s.collect(30)[0] for s in streams] == expected
    assert max(batched.batch_sizes) == len(prompts)
    for i in range(len(prompts)):
        (k1, v1), (k2, v2) = kv_alone[f"a{i}"], kv_batched[f"b{i}"]
        assert torch.allclose(k1, k2, atol=1e-4) and torch.allclose(v1, v2, atol=1e-4), f"request {i}"
    assert_pool_clean(batched)
    batched.shutdown()


@pytest.mark.parametrize("mode", ["all", "off"])
def test_attention_reads_only_each_sequences_own_blocks(mode: str):
    """Prompt groups padded past a sequence's keys get zero keys, and a padded decode table
    repeats the sequence's own last block: no row ever reads another sequence's blocks."""
    engine = tiny_engine(
        start=False, batch_invariance=mode, kv_memory_bytes=1 << 20, max_prefill_tokens_per_step=512
    )
    rng = random.Random(4)
    for i, n in enumerate((5, 70, 33)):
        engine.submit(EngineRequest(f"r{i}", _prompt(rng, n), GREEDY))
    for _ in range(3):  # one prefill step, then decode steps
        with engine._lock:
            scheduled = engine.scheduler.schedule().scheduled
        batch, _ = engine.runner.build_batch(scheduled)
        owners = {}
        for item in scheduled:
            for block in item.seq.block_table:
                owners[block] = item.seq.seq_id
        seen = [set(s.block_ids.tolist()) for s in batch.seqs]
        if batch.decode is not None:
            seen += [set(row.tolist()) for row in batch.decode.block_table]
        assert len(seen) == len(scheduled)
        for blocks in seen:
            assert len({owners[b] for b in blocks}) == 1, f"a row reads blocks of {blocks}"
        engine.step()
    engine.start()
    engine.shutdown()


@pytest.mark.parametrize("float_weights", ["fp32", "bf16"])
def test_a_cached_answer_gives_the_next_turn_the_numbers_of_a_cold_read(float_weights: str):
    """Turn 2 = turn 1's prompt + its greedy answer + new tokens. Warm, the answer's blocks come
    from the cache, where turn 1's decode steps wrote them; cold (another salt), they are a
    prompt's. The K/V must be the same bits: a decode row is computed as a prompt row would be."""
    rng = random.Random(11)
    engine = tiny_engine(kv_memory_bytes=1 << 20, max_num_seqs=6, float_weights=float_weights)
    kv = record_kv(engine)
    for trial in range(6):
        first = _prompt(rng, rng.randrange(5, 60))
        answer, _ = engine.submit(
            EngineRequest(
                f"t1-{trial}", first, SamplingParams(max_tokens=rng.randrange(20, 50), ignore_eos=True)
            )
        ).collect(30)
        second = first + answer + _prompt(rng, rng.randrange(1, 20))
        warm, final = engine.submit(EngineRequest(f"warm{trial}", second, GREEDY)).collect(30)
        cold, _ = engine.submit(
            EngineRequest(f"cold{trial}", second, GREEDY, cache_salt=f"c{trial}")
        ).collect(30)
        assert final.stats.cached_tokens_device > len(first)  # the answer's blocks were hits
        assert warm == cold
        assert _same_kv(kv[f"warm{trial}"], kv[f"cold{trial}"]), f"trial {trial}: K/V differ in the last bits"
    assert_pool_clean(engine)
    engine.shutdown()


def test_a_greedy_request_preempted_mid_answer_gets_the_numbers_it_gets_alone():
    """Four answers that outgrow a 10-block pool: some are preempted, their generated tokens read
    again as a prompt on re-admission. Tokens and K/V must equal each request's alone."""
    rng = random.Random(5)
    greedy = SamplingParams(max_tokens=60, ignore_eos=True)
    prompts = [_prompt(rng, 20) for _ in range(4)]
    alone = tiny_engine(kv_memory_bytes=1 << 22)
    kv_alone = record_kv(alone)
    expected = [alone.submit(EngineRequest(f"a{i}", p, greedy)).collect(30)[0] for i, p in enumerate(prompts)]
    alone.shutdown()
    engine = tiny_engine(start=False, kv_memory_bytes=80 * 1024, max_num_seqs=4)
    kv = record_kv(engine)
    preempt, preempted = engine.scheduler._preempt, []
    engine.scheduler._preempt = lambda seq: preempted.append(seq.seq_id) or preempt(seq)
    streams = [engine.submit(EngineRequest(f"b{i}", p, greedy)) for i, p in enumerate(prompts)]
    engine.start()
    got = [stream.collect(60) for stream in streams]
    assert preempted  # the pool did run out
    for i, (tokens, _) in enumerate(got):
        assert tokens == expected[i]
        assert _same_kv(kv[f"b{i}"], kv_alone[f"a{i}"]), f"request {i}: K/V differ in the last bits"
    assert_pool_clean(engine)
    engine.shutdown()
