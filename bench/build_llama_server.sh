#!/usr/bin/env bash
# Build llama.cpp's llama-server from the sources vendored in the pinned llama-cpp-python sdist,
# with the same portable GGML flags as nrvna's llama-cpp-python build. Cached outside the repo;
# prints the binary's path.   usage: bash bench/build_llama_server.sh
set -euo pipefail
VERSION=0.3.36
FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF"
cache="${NRVNA_BENCH_CACHE:-$HOME/.cache/nrvna-bench}/llama-server-$VERSION-$(echo "$FLAGS" | sha256sum | cut -c1-12)"
binary="$cache/build/bin/llama-server"
if [ ! -x "$binary" ]; then
  mkdir -p "$cache"
  if [ ! -d "$cache/src" ]; then
    tmp=$(mktemp -d)
    python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp"
    tar xzf "$tmp"/llama_cpp_python-$VERSION.tar.gz -C "$tmp"
    mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$cache/src"
    rm -rf "$tmp"
  fi
  echo "building llama-server (several minutes on 2 cores)" >&2
  cmake -S "$cache/src" -B "$cache/build" -G Ninja -DCMAKE_BUILD_TYPE=Release $FLAGS \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
  cmake --build "$cache/build" --target llama-server -j "$(nproc)" >&2
fi
echo "$binary"
