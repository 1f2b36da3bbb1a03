"""Build DeepInfer's C++ engine core (`deepinfer._C`) from the deepinfer==0.1.0 sdist on a CPU.

What is built is DeepInfer's own code: setup.py's COMMON_SOURCES (scheduler, block manager,
sequences, outputs, ZOS, input metadata, their pybind modules) with the read-only
`Sequence.block_table` patch of ikcode.engines.deepinfer.patches applied. Only the CUDA utility
file is swapped for shim/ (cuda_utils.hpp/.cpp and graph_timer_cuda.cpp: current stream, async
copies, IPC, events, graphs), and a `<format>` header over Debian's libfmt-dev serves the g++ 12
libstdc++ that lacks one (csrc/utils/log.hpp:7).

The result is cached under IKCODE_DEEPINFER_BUILD_DIR (default ~/.cache/ikcode/deepinfer-cpu),
keyed by the sdist's sha256, the torch and Python versions, and a hash of the shim, the patch and
this file: it builds once per machine. `python tests/deepinfer_build/build.py` builds and prints
the folder to put on sys.path (it holds the sdist's `deepinfer` and `deep_cluster` packages).
"""

from __future__ import annotations

import fcntl
import hashlib
import html.parser
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SDIST_NAME = "deepinfer-0.1.0.tar.gz"
SDIST_SHA256 = "959b9bd010893b4c6dc60be0dd822e10e7f1ae1e53289233a83741f76c3d681a"
INDEX_URL = "https://pypi.org/simple/deepinfer/"
HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SHIM = HERE / "shim"
PATCH = REPO / "ikcode" / "engines" / "deepinfer" / "patches" / "apply.py"
# setup.py:25-37, COMMON_SOURCES; cuda_utils.cpp and graph_timer_cuda.cpp (setup.py:62-66) are
# replaced by shim/cpu_utils.cpp.
SOURCES = [
    "csrc/pybind.cpp",
    "csrc/engine/pybind.cpp",
    "csrc/engine/pybind_sequence.cpp",
    "csrc/engine/pybind_scheduler.cpp",
    "csrc/engine/pybind_output.cpp",
    "csrc/engine/zos.cpp",
    "csrc/engine/input_metadata/block_load_plan.cpp",
    "csrc/engine/input_metadata/prepare_tensor_input_base.cpp",
    "csrc/engine/input_metadata/prepare_tensor_input_v4.cpp",
    "csrc/engine/prepare_sample.cpp",
    "csrc/graph_timer/pybind.cpp",
    "csrc/cpu_utils.cpp",
]


class BuildError(Exception):
    pass


def cache_root() -> Path:
    env = os.environ.get("IKCODE_DEEPINFER_BUILD_DIR")
    return Path(env) if env else Path.home() / ".cache" / "ikcode" / "deepinfer-cpu"


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def fetch_sdist(root: Path) -> Path:
    """The sdist from the package index (PEP 503 page), checked against its sha256."""
    path = root / SDIST_NAME
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == SDIST_SHA256:
        return path
    index = os.environ.get("IKCODE_DEEPINFER_INDEX_URL", INDEX_URL)
    with urllib.request.urlopen(index, timeout=60) as page:
        parser = _Links()
        parser.feed(page.read().decode("utf-8"))
    urls = [urllib.parse.urljoin(index, h) for h in parser.hrefs if h.split("#")[0].endswith(SDIST_NAME)]
    if not urls:
        raise BuildError(f"{SDIST_NAME} is not listed on {index}")
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    with urllib.request.urlopen(urls[0].split("#")[0], timeout=300) as resp, tmp.open("wb") as out:
        shutil.copyfileobj(resp, out)
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        tmp.unlink()
        raise BuildError(f"{SDIST_NAME}: sha256 {digest}, expected {SDIST_SHA256}")
    tmp.replace(path)
    return path


def build_key() -> str:
    """What the compiled core depends on: the sdist, torch, Python, the shim, the patch, the recipe."""
    import torch

    patch = _load_patch()  # what the patch inserts and where, not how its file is worded
    h = hashlib.sha256()
    parts = (SDIST_SHA256, torch.__version__, sys.version.split()[0], " ".join(SOURCES), RECIPE, patch.MARKER,
             patch.ANCHOR)  # fmt: skip
    for part in parts:
        h.update(part.encode() + b"\0")
    for f in sorted(SHIM.iterdir()):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


# The only Python >= 3.12 syntax in the sdist's Python tree (every file parsed with Python 3.11's
# ast): two PEP 695 generic classes. On 3.11 they are spelled with typing.Generic, which means the
# same; nothing else in the tree is changed.
PY311_REWRITES = {
    "deepinfer/environ.py": (
        "class EnvVar[T]:",
        "from typing import Generic as _Generic, TypeVar as _TypeVar\n\n"
        'T = _TypeVar("T")\n\n\nclass EnvVar(_Generic[T]):',
    ),
    "deepinfer/model_executor/utils.py": (
        "class Movable[T]:",
        "from typing import Generic as _Generic\n\n\nclass Movable(_Generic[T]):",
    ),
}


def python_tree(src: Path, pkg: Path) -> None:
    """The sdist's `deepinfer` and `deep_cluster` packages, importable by this Python."""
    for name in ("deepinfer", "deep_cluster"):
        shutil.copytree(src / name, pkg / name)
    if sys.version_info < (3, 12):
        for rel, (old, new) in PY311_REWRITES.items():
            path = pkg / rel
            text = path.read_text(encoding="utf-8")
            if text.count(old) != 1:
                raise BuildError(f"{rel}: expected one {old!r}")
            path.write_text(text.replace(old, new), encoding="utf-8")


RECIPE = (
    "-O1 -g0 -std=c++20 -fPIC -fvisibility=hidden -Wno-deprecated-declarations "
    "-D_GLIBCXX_USE_CXX11_ABI=1 -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H"
)


def _flags(src: Path, fmt_include: Path) -> list[str]:
    from torch.utils import cpp_extension

    includes = [
        fmt_include,
        src / "csrc",
        *map(Path, cpp_extension.include_paths()),
        Path(sysconfig.get_paths()["include"]),
    ]
    return [*RECIPE.split(), *[f"-I{p}" for p in includes]]


def _compile(cmd: list[str], target: Path, log: Path) -> None:
    """Run cmd, which writes target + '.part'; renamed on success, so a present target is whole."""
    if target.is_file():
        return
    part = target.with_name(target.name + ".part")
    done = subprocess.run([*cmd, "-o", str(part)], capture_output=True, text=True)
    if done.returncode:
        log.write_text(done.stderr)
        raise BuildError(f"compile failed: {' '.join(cmd[-2:])}\n{done.stderr[-4000:]}")
    part.replace(target)


def _load_patch() -> Any:
    """ikcode's patch module, loaded from its file (the ikcode package need not be importable)."""
    spec = importlib.util.spec_from_file_location("_ikcode_deepinfer_patch", PATCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(jobs: int | None = None, quiet: bool = False) -> Path:
    """The folder holding the built `deepinfer` package (put it on sys.path). Cached; a build
    that was interrupted goes on from the objects it finished."""
    root = cache_root()
    out = root / build_key()
    if (out / "ok").is_file():
        return out / "pkg"
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; the others wait, then reuse it
        if (out / "ok").is_file():
            return out / "pkg"
        return _build(out, jobs, quiet)


def _build(out: Path, jobs: int | None, quiet: bool) -> Path:
    root = out.parent
    if shutil.which("g++") is None:
        raise BuildError("g++ not found")
    if not Path("/usr/include/fmt/format.h").is_file():
        raise BuildError("libfmt-dev is not installed (apt-get install libfmt-dev)")
    sdist = fetch_sdist(root)
    src = out / "src" / "deepinfer-0.1.0"
    if not (src / "csrc" / "cpu_utils.cpp").is_file():
        shutil.rmtree(out / "src", ignore_errors=True)
        (out / "src").mkdir(parents=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(out / "src", filter="data")
        if not _load_patch().apply(src):
            raise BuildError("the block_table patch did not change pybind_sequence.cpp")
        shutil.copy(SHIM / "cuda_utils.hpp", src / "csrc" / "cuda_utils.hpp")
        shutil.copy(SHIM / "cpu_utils.cpp", src / "csrc" / "cpu_utils.cpp")
    fmt_include = out / "include"
    fmt_include.mkdir(exist_ok=True)
    shutil.copy(SHIM / "format", fmt_include / "format")
    flags = _flags(src, fmt_include)
    # Every file includes torch/extension.h; parsing it is most of each file's compile time, so
    # it is parsed once into a precompiled header that each compile then loads.
    pch = fmt_include / "torch_ext.hpp"
    pch.write_text("#pragma once\n#include <torch/extension.h>\n")
    _compile(
        ["g++", *flags, "-x", "c++-header", str(pch)], pch.with_name(pch.name + ".gch"), out / "build.log"
    )
    flags += ["-Winvalid-pch", "-include", str(pch)]
    objs = [out / "obj" / (s.replace("/", "_") + ".o") for s in SOURCES]
    objs[0].parent.mkdir(exist_ok=True)
    cmds = [["g++", *flags, "-c", str(src / s)] for s in SOURCES]
    workers = jobs or int(os.environ.get("IKCODE_DEEPINFER_BUILD_JOBS", "2"))
    if not quiet:
        print(
            f"building deepinfer._C from {sdist.name} ({len(cmds)} files, {workers} at a time) in {out}",
            file=sys.stderr,
        )
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda c, o: _compile(c, o, out / "build.log"), cmds, objs))
    import torch

    pkg = out / "pkg"
    shutil.rmtree(pkg, ignore_errors=True)
    python_tree(src, pkg)
    torch_lib = Path(torch.__file__).parent / "lib"
    target = pkg / "deepinfer" / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    libs = ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-lpthread"]
    link = ["g++", "-shared", *map(str, objs), f"-L{torch_lib}", *libs, f"-Wl,-rpath,{torch_lib}"]
    _compile(link, target, out / "build.log")
    (out / "ok").write_text(build_key() + "\n")
    return pkg


if __name__ == "__main__":
    print(build())
