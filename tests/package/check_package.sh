#!/usr/bin/env bash
# Installs meshtorch from BUILD_DIR into a temporary prefix, then configures, builds and runs a
# consumer project against the installed package config.
set -euo pipefail
build_dir="$1" libtorch="$2" source_dir="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
# No optimisation (an empty build type): the check is that the package links and runs.
cmake -S "$source_dir/consumer" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE= \
  -DCMAKE_PREFIX_PATH="$work/prefix" -DMESHTORCH_LIBTORCH="$libtorch" \
  -DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache || true)" >/dev/null
cmake --build "$work/build" | grep -vE '^\[[0-9]+/[0-9]+\]' || true  # only compiler messages
[[ -x "$work/build/consumer" && -x "$work/build/chat" ]] || { echo "the consumer project did not build"; exit 1; }
"$work/build/consumer"
"$work/build/chat"
