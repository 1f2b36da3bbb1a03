"""Can this machine run DeepInfer? Checked before anything is imported, with a message that says
what is missing and what to do. DeepInfer 0.1.0 builds only for NVIDIA SM100 (B200) or Ascend 950,
with CUDA 13 and Python >= 3.12 (facts: deepinfer.md, first paragraph)."""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

INSTALL_HINT = (
    "install it on the B200 machine with `pip install deepinfer==0.1.0` (Python 3.12, CUDA 13), "
    "then apply ikcode's block-table patch: see ikcode/engines/deepinfer/patches/README.md"
)


class MachineCheckError(RuntimeError):
    """This machine cannot run the DeepInfer backend; the message says why and what to do."""


@dataclass(frozen=True)
class Gpu:
    name: str
    compute_capability: str  # "10.0" for B200


def query_gpus() -> list[Gpu]:
    """The GPUs nvidia-smi reports (none when it is absent or fails)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, _, cap = line.rpartition(",")
        gpus.append(Gpu(name.strip(), cap.strip()))
    return gpus


def check_machine(
    data_parallel_size: int,
    *,
    gpus: Callable[[], list[Gpu]] | None = None,
    find_spec: Callable[[str], object] | None = None,
    python: tuple[int, int] | None = None,
) -> None:
    """Raise MachineCheckError unless there are enough SM100 GPUs and deepinfer is importable."""
    found = (gpus or query_gpus)()
    find_spec = find_spec or importlib.util.find_spec
    python = python or (sys.version_info[0], sys.version_info[1])
    if not found:
        raise MachineCheckError(
            "no NVIDIA GPU found (nvidia-smi is missing or reports none): the deepinfer profile needs "
            f"{data_parallel_size} B200 GPU(s); on this machine use the `local` profile (embedded engine)"
        )
    wrong = [g for g in found if not g.compute_capability.startswith("10.")]
    if wrong:
        g = wrong[0]
        raise MachineCheckError(
            f"wrong GPU: found {g.name} (compute capability {g.compute_capability}); DeepInfer 0.1.0 "
            "runs only on SM100 (B200, compute capability 10.x) or Ascend 950"
        )
    if len(found) < data_parallel_size:
        raise MachineCheckError(
            f"found {len(found)} B200 GPU(s), the profile asks for data_parallel_size={data_parallel_size}: "
            "lower [hardware] cards in the profile or use a bigger machine"
        )
    if python < (3, 12):
        raise MachineCheckError(
            f"DeepInfer needs Python >= 3.12; ikcode runs on {python[0]}.{python[1]}: "
            "install ikcode in a Python 3.12 environment"
        )
    if find_spec("deepinfer") is None:
        raise MachineCheckError(f"the deepinfer package is not installed: {INSTALL_HINT}")


def load_backend() -> SimpleNamespace:
    """Import deepinfer (lazily: only in a rank process, with its environment already set). The
    backend is the names the adapter uses; `SamplingParams` is not exported by the package
    (sampling_params.py:47) and `RequestOutput` reads the output pointers (pybind_output.cpp:12-34)."""
    try:
        llm_engine = importlib.import_module("deepinfer.engine.llm_engine")
        arg_utils = importlib.import_module("deepinfer.engine.arg_utils")
        sampling = importlib.import_module("deepinfer.sampling_params")
        engine_core = importlib.import_module("deepinfer._C.engine")
    except ImportError as err:
        raise MachineCheckError(f"deepinfer failed to import ({err}): {INSTALL_HINT}") from None
    return SimpleNamespace(
        LLMEngine=llm_engine.LLMEngine,
        EngineArgs=arg_utils.EngineArgs,
        SamplingParams=sampling.SamplingParams,
        RequestOutput=engine_core.RequestOutput,
    )
