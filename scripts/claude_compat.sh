#!/usr/bin/env bash
# Check the Claude Code client npm serves today (or the version given) against ikcode: installs
# it into a temporary prefix, then runs scripts/claude_compat.py (two turns through `ikcode claude`
# on the default profile, a tool round trip, the turn-2 cache hit, a clean stderr, the status line).
#   scripts/claude_compat.sh            # @anthropic-ai/claude-code@latest
#   scripts/claude_compat.sh 2.1.332    # a given version
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

version="${1:-latest}"
prefix="$(mktemp -d -t ikcode-claude-XXXXXX)"
trap 'rm -rf "$prefix"' EXIT
echo "==> npm install @anthropic-ai/claude-code@$version into $prefix"
npm install --no-audit --no-fund --silent --prefix "$prefix" "@anthropic-ai/claude-code@$version"
.venv/bin/python scripts/claude_compat.py --claude "$prefix/node_modules/.bin/claude"
