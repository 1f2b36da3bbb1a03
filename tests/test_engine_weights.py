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
