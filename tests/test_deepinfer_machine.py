"""The DeepInfer backend on a machine that cannot run it: a clear message, nothing imported;
the profile becomes the adapter's settings and environment."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ikcode import daemon
from ikcode.engines.deepinfer import (
    REQUIRED_ENVIRONMENT,
    DeepInferConfig,
    MachineCheckError,
    check_machine,
    machine,
)
from ikcode.engines.deepinfer.machine import Gpu
from ikcode.profiles import load_profile
from ikcode.stack import build_stack

B200 = Gpu("NVIDIA B200", "10.0")
H200 = Gpu("NVIDIA H200", "9.0")


def ok(name: str) -> object:
    return object()


@pytest.mark.parametrize(
    ("gpus", "find_spec", "python", "message"),
    [
        ([], ok, (3, 12), "no NVIDIA GPU found"),
        ([H200] * 4, ok, (3, 12), "wrong GPU: found NVIDIA H200 (compute capability 9.0)"),
        ([B200] * 2, ok, (3, 12), "found 2 B200 GPU(s), the profile asks for data_parallel_size=4"),
        ([B200] * 4, ok, (3, 11), "DeepInfer needs Python >= 3.12"),
        ([B200] * 4, lambda name: None, (3, 12), "the deepinfer package is not installed"),
    ],
)
def test_machine_check_says_what_is_missing(gpus, find_spec, python, message):
    with pytest.raises(MachineCheckError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        check_machine(4, gpus=lambda: gpus, find_spec=find_spec, python=python)


def test_a_b200_machine_with_deepinfer_passes():
    check_machine(4, gpus=lambda: [B200] * 4, find_spec=ok, python=(3, 12))


def test_importing_the_adapter_does_not_import_deepinfer():
    code = "import sys, ikcode.engines.deepinfer, ikcode.stack; print('deepinfer' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_ikcode_up_with_the_deepinfer_profile_on_a_cpu_machine_says_why(monkeypatch):
    monkeypatch.setattr(machine, "query_gpus", lambda: [])
    with pytest.raises(daemon.DaemonError, match="cannot start DeepInfer on this machine: no NVIDIA GPU"):
        build_stack(load_profile("deepinfer-4xb200"), model_path="/nonexistent")
    monkeypatch.setattr(machine, "query_gpus", lambda: [H200])
    with pytest.raises(daemon.DaemonError, match="wrong GPU"):
        build_stack(load_profile("deepinfer-4xb200"))


def test_profile_becomes_the_adapter_settings_and_environment():
    config = DeepInferConfig.from_profile(load_profile("deepinfer-4xb200"), "/models/dsv4")
    assert (config.model, config.data_parallel_size, config.max_model_len) == ("/models/dsv4", 4, 1048576)
    assert config.max_num_seqs == 256 and config.gpu_memory_utilization == 0.9
    # host_cache_mb = 262144 holds the pages and the window snapshots (8 GiB of it), per rank:
    assert config.snapshot_bytes_per_rank == 8192 * 1024**2 // 4
    assert config.host_tier_bytes_per_rank == (262144 - 8192) * 1024**2 // 4


@pytest.mark.parametrize(
    "cache,snapshots_mb,pages_mb",
    [
        ({"host_cache_mb": 4}, 0.5, 3.5),  # an eighth of a small host budget, not all of it
        ({"host_cache_mb": 1024, "snapshot_cache_mb": 100}, 100, 924),
        ({"host_cache_mb": 64, "snapshot_cache_mb": 100}, 64, 0),  # never more than the budget
        ({}, 8192, 0),  # no host tier: the snapshots' own budget
    ],
)
def test_host_cache_mb_is_shared_between_pages_and_snapshots(cache, snapshots_mb, pages_mb):
    profile = load_profile("deepinfer-4xb200")
    sized = ("host_cache_mb", "snapshot_cache_mb")
    profile.cache = {k: v for k, v in profile.cache.items() if k not in sized}
    profile.cache.update(cache)
    config = DeepInferConfig.from_profile(profile, "/models/dsv4")
    assert config.snapshot_bytes_per_rank == int(snapshots_mb * 1024**2) // 4
    assert config.host_tier_bytes_per_rank == int(pages_mb * 1024**2) // 4
    env = config.process_environment(2)  # rank 2's process: one GPU, the rendezvous address
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29500")
    for key, value in REQUIRED_ENVIRONMENT.items():
        assert env[key] == value
    assert env["DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"] == "compact"
    assert env["DEEPINFER_PREFILL_STORE_EXTRA_STATE"] == "1"
    assert config.yoco_keep_tokens == 140


@pytest.mark.deepinfer
def test_block_table_patch_on_the_real_sdist(tmp_path):
    """The patch against the sdist's own pybind_sequence.cpp: one binding after `branch_id`, an
    already-patched check that `py::arg("block_table")` (:150) cannot satisfy, and a clear error
    without its anchor. That the patched file compiles is shown by the engine-core build itself."""
    import tarfile

    from ikcode.engines.deepinfer.patches.apply import BINDING, PatchError, apply
    from tests.deepinfer_build import build

    try:
        sdist = build.fetch_sdist(build.cache_root())
    except (build.BuildError, OSError) as err:
        pytest.skip(f"the deepinfer sdist cannot be fetched: {err}")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    root = tmp_path / "deepinfer-0.1.0"
    binding = root / "csrc" / "engine" / "pybind_sequence.cpp"
    original = binding.read_text()
    assert 'py::arg("block_table")' in original and BINDING not in original
    assert apply(root) is True
    text = binding.read_text()
    assert text.count(BINDING) == 1
    assert text.index('"branch_id"') < text.index(BINDING) < text.index("py::class_<SequenceMetadata>")
    assert apply(root) is False  # idempotent
    binding.write_text(original.replace('"branch_id"', '"renamed"'))
    with pytest.raises(PatchError, match="branch_id"):
        apply(root)
