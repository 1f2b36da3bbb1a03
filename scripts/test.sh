#!/usr/bin/env bash
# Set up everything the tests need (venv, default model, the real Claude Code client from npm)
# and run the whole test suite. "No tests collected" is a failure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

./install.sh --dev

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

# The real Claude Code client, pinned, in a project-local folder (no global install needed).
claude_version="${IKCODE_CLAUDE_VERSION:-2.1.197}"
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
llamacpp_spec="llama-cpp-python[server]==${IKCODE_LLAMACPP_VERSION:-0.3.36}"
if [ "${IKCODE_TEST_LLAMACPP:-1}" != 0 ] && ! .venv/bin/python -c "import llama_cpp.server" 2>/dev/null; then
  echo "==> installing $llamacpp_spec (compiles llama.cpp unless pip has it cached)"
  timeout 2400 .venv/bin/pip install -q "$llamacpp_spec" ||
    echo "(llama-cpp-python not installed: its tests will skip)"
fi

set +e
.venv/bin/python -m pytest -q "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "no tests were collected: failing" >&2
  exit 1
fi
exit "$status"
