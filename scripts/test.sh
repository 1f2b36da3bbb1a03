#!/usr/bin/env bash
# Set up everything the tests need (venv, default model, the real Claude Code client from npm)
# and run the whole test suite. "No tests collected" is a failure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

./install.sh --dev
venv="${IKCODE_VENV:-$PWD/.venv}"  # where install.sh put it

# Shells for the `ikcode env` quoting tests (skipped, with a reason, where they cannot be had).
if ! command -v zsh >/dev/null || ! command -v fish >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq zsh fish) >/dev/null 2>&1 || echo "(zsh/fish not installed)"
  fi
fi

# tmux, in which the tests start the client's interactive screen (skipped, saying why, without it).
if ! command -v tmux >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq tmux) >/dev/null 2>&1 || echo "(tmux not installed)"
  fi
fi

# DeepInfer's engine core (deepinfer._C), built from the deepinfer==0.1.0 sdist on the CPU for the
# `-m deepinfer` tests: g++ and libfmt-dev (its logging uses <format>, which g++ 12 lacks). Cached
# in ~/.cache/ikcode/deepinfer-cpu, so only the first run compiles (two files at a time); where it
# cannot be built, those tests skip and say why.
if [ ! -f /usr/include/fmt/format.h ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq g++ libfmt-dev) >/dev/null 2>&1 || echo "(libfmt-dev not installed)"
fi
echo "==> DeepInfer's engine core (built once, then cached)"
timeout 2400 "$venv"/bin/python tests/deepinfer_build/build.py ||
  echo "(DeepInfer's engine core not built: the deepinfer tests will skip)"

# The real Claude Code client, pinned, in a project-local folder (no global install needed).
claude_version="${IKCODE_CLAUDE_VERSION:-2.1.332}"
claude_dir="$PWD/.tools/claude-code"
if command -v npm >/dev/null 2>&1; then
  if [ ! -x "$claude_dir/node_modules/.bin/claude" ] ||
     ! "$claude_dir/node_modules/.bin/claude" --version 2>/dev/null | grep -q "^$claude_version"; then
    echo "==> installing @anthropic-ai/claude-code@$claude_version"
    npm install --no-audit --no-fund --silent --prefix "$claude_dir" "@anthropic-ai/claude-code@$claude_version"
  fi
  export IKCODE_TEST_CLAUDE_BIN="$claude_dir/node_modules/.bin/claude"
fi

# llama.cpp's OpenAI-compatible server, an independent engine for the translation tests. pip
# builds it from source unless it has the wheel cached (~15 min on two cores, once); where it
# cannot be built those tests skip and say why. IKCODE_TEST_LLAMACPP=0 leaves it out.
# A wheel pip cached on another CPU (a shared cache, a copied home) dies of SIGILL here: then a
# portable build (-DGGML_NATIVE=OFF) is made once, kept apart from pip's cache (whose key is the
# source, not the CPU), and installed over it.
llamacpp_version="${IKCODE_LLAMACPP_VERSION:-0.3.36}"
llamacpp_spec="llama-cpp-python[server]==$llamacpp_version"
portable_dir="${XDG_CACHE_HOME:-$HOME/.cache}/ikcode/wheels/llama-cpp-python-$llamacpp_version-portable"
llamacpp_runs() {  # loads the default model and computes one token, in a child process
  timeout 300 "$venv"/bin/python - >/dev/null 2>&1 <<'PY'
import llama_cpp.server
from ikcode.model.default_model import default_model_path
llama = llama_cpp.Llama(model_path=str(default_model_path()), n_ctx=64, n_threads=1, verbose=False)
llama.create_completion("Hi", max_tokens=1)
PY
}
install_portable_llamacpp() {
  if ! ls "$portable_dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "==> building a portable llama-cpp-python $llamacpp_version (GGML_NATIVE=OFF; ~15 min once)"
    CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_NATIVE=OFF" timeout 2400 "$venv"/bin/pip wheel -q --no-deps \
      --no-cache-dir --no-binary llama-cpp-python -w "$portable_dir" "llama-cpp-python==$llamacpp_version" ||
      return 1
  fi
  wheel="$(ls "$portable_dir"/llama_cpp_python-*.whl | head -n 1)"
  "$venv"/bin/pip install -q --force-reinstall --no-deps "$wheel" && "$venv"/bin/pip install -q "$wheel[server]"
}
llamacpp_import() { "$venv"/bin/python -c "import llama_cpp.server" >/dev/null 2>&1; }
if [ "${IKCODE_TEST_LLAMACPP:-1}" != 0 ]; then
  status=0; llamacpp_import || status=$?
  if [ "$status" != 0 ] && [ "$status" != 132 ]; then  # 132: there, but killed by SIGILL
    if ls "$portable_dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
      install_portable_llamacpp || true
    else
      echo "==> installing $llamacpp_spec (compiles llama.cpp unless pip has it cached)"
      timeout 2400 "$venv"/bin/pip install -q "$llamacpp_spec" ||
        echo "(llama-cpp-python not installed: its tests will skip)"
    fi
  fi
  status=0; llamacpp_import || status=$?
  if [ "$status" = 132 ] || { [ "$status" = 0 ] && ! llamacpp_runs; }; then
    echo "==> llama-cpp-python does not run on this CPU (a wheel built elsewhere?): installing a portable build"
    { install_portable_llamacpp && llamacpp_runs; } ||
      echo "(llama-cpp-python still cannot run here: its tests will skip, saying why)"
  fi
fi

set +e
"$venv"/bin/python -m pytest -q "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "no tests were collected: failing" >&2
  exit 1
fi
exit "$status"
