"""Which weights each row reads: the configured kinds are applied (and reported) as asked, "auto"
picks bf16 only on a CPU that multiplies it natively, and a bad value is refused up front."""

from __future__ import annotations

import pytest
import torch

from ikcode.engines.embedded import EmbeddedEngineConfig
from ikcode.engines.embedded.model_runner import fast_bf16_cpu
from ikcode.model import int4
from tests.tiny_model import tiny_config, tiny_engine, tiny_state_dict


@pytest.mark.parametrize(
    ("weights", "float_weights", "layer_dtype", "decode_weights"),
    [
        ("fp32", "fp32", torch.float32, "fp32"),
        ("fp32", "bf16", torch.bfloat16, "bf16"),
        ("int4", "bf16", torch.bfloat16, "int4"),
        ("int8", "fp32", torch.float32, "int8"),
        ("int8", "bf16", torch.bfloat16, "int8"),
        ("int4", "fp32", torch.float32, "int4"),
    ],
)
def test_the_runner_reads_the_weights_it_reports(weights, float_weights, layer_dtype, decode_weights):
    engine = tiny_engine(weights=weights, float_weights=float_weights, start=False)
    runner = engine.runner
    assert (runner.float_weights, runner.decode_weights) == (float_weights, decode_weights)
    layer = runner.model.layers[0]
    assert {w.dtype for w in (layer.qkv_weight_t, layer.o_weight_t, layer.gate_up_weight_t)} == {layer_dtype}
    assert runner.model.lm_head_t.dtype == torch.float32  # the output layer is never bf16
    assert bool(layer.packed) == (weights != "fp32")
    engine.shutdown()


def test_auto_is_bf16_only_where_the_cpu_has_it():
    engine = tiny_engine(float_weights="auto", start=False)
    assert engine.runner.float_weights == ("bf16" if fast_bf16_cpu() else "fp32")
    engine.shutdown()


def test_an_unknown_kind_is_refused_when_built():
    with pytest.raises(ValueError, match="float_weights must be fp32, bf16 or auto"):
        EmbeddedEngineConfig(float_weights="fp16").validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fp32_gemm must be onednn or mkl"):
        EmbeddedEngineConfig(fp32_gemm="blas").validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weights must be fp32, int8 or int4"):
        EmbeddedEngineConfig(weights="int3").validate()  # type: ignore[arg-type]


def test_quantized_copies_come_from_the_fp32_weights():
    """bf16 first would pack bf16-rounded weights: the quantized copies are taken before, and
    quantizing a model already in bf16 is refused."""
    engine = tiny_engine(weights="int4", float_weights="bf16", start=False)
    fp32 = tiny_state_dict(tiny_config("llama", False), 0)["model.layers.0.mlp.down_proj.weight"]
    packed = engine.runner.model.layers[0].packed["down"]
    assert torch.equal(packed.scales_and_zeros, int4.quantize(fp32.t())[1])
    with pytest.raises(RuntimeError, match="before matmul_weights_to"):
        engine.runner.model.quantize("int4")
    engine.shutdown()


def _forward_logits(engine, prompt: list[int]) -> torch.Tensor:
    from ikcode.engines.base import EngineRequest, SamplingParams

    seen: list[torch.Tensor] = []
    run = engine.runner.run

    def keep(scheduled):
        logits, which = run(scheduled)
        seen.append(logits)
        return logits, which

    engine.runner.run = keep
    engine.submit(EngineRequest("r", prompt, SamplingParams(max_tokens=1, temperature=0.0)))
    while engine.scheduler.has_work():
        engine.step()
    return seen[-1]


def test_fp32_weights_go_through_onednn_with_the_same_numbers_as_mkl():
    """On a CPU the fp32 matmul weights are packed for oneDNN (faster than MKL here:
    bench/onednn_matmul.py). The logits agree with MKL's to fp32 rounding."""
    prompt = list(range(5, 45))
    onednn = tiny_engine(start=False)
    assert all(
        getattr(onednn.runner.model.layers[0], name).is_mkldnn for name in ("qkv_weight_t", "down_weight_t")
    )
    mkl = tiny_engine(start=False, fp32_gemm="mkl")
    assert not mkl.runner.model.layers[0].qkv_weight_t.is_mkldnn
    torch.testing.assert_close(
        _forward_logits(onednn, prompt), _forward_logits(mkl, prompt), rtol=1e-4, atol=1e-4
    )
    for engine in (onednn, mkl):
        engine.shutdown()


def test_where_onednn_computes_wrong_the_weights_stay_with_mkl(monkeypatch, caplog):
    """The first matmul is checked against torch.mm before any weight is repacked: a oneDNN that
    cannot run it right leaves every weight as it was, and says so."""
    from ikcode.model import llama

    monkeypatch.setattr(
        llama, "_onednn_packed", lambda w: llama.torch.ops.mkldnn._reorder_linear_weight(0 * w.t())
    )
    engine = tiny_engine(start=False)
    layers = engine.runner.model.layers
    assert not any(layer.qkv_weight_t.is_mkldnn for layer in layers)
    assert "oneDNN could not pack the fp32 weights" in caplog.text
    assert _forward_logits(engine, list(range(5, 20))).isfinite().all()
    engine.shutdown()
