#!/usr/bin/env bash
# nrvna against llama-server on a machine with a CUDA GPU, in one command.
#
# Builds llama.cpp once with CUDA from the sources vendored in the pinned llama-cpp-python sdist:
# the same build gives llama-cpp-python its libllama (the sdist's Python package is put beside it
# on PYTHONPATH, so no second compile) and gives llama-server. Makes the models with
# bench/random_model.py (random weights, SmolLM2's tokenizer: smol = SmolLM2-135M's shape,
# 1b = Llama-3.2-1B's, host = 1 layer of width 64), adds the real SmolLM2 if models/ has it, and
# runs bench/vs_llama_server.py --quick on each with every layer on the GPU, then bench/host_bound.py
# on the 1-layer model (the host's work per token, profiled), then bench/models.py (several models
# against llama-server's router: chat-a and chat-b the `smol` model, the embedding model MiniLM).
# Tables go to stdout and to OUTDIR.
#
#   usage: bash bench/gpu.sh [OUTDIR]
#   NRVNA_LLAMA_SDIST  the llama-cpp-python sdist (.tar.gz/.tar.xz or its folder); default: pip download
#   NRVNA_VOCAB_GGUF   where the tokenizer comes from (default models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   NRVNA_CUDA_ARCH    CMAKE_CUDA_ARCHITECTURES (default: native, the GPU of this machine)
#   NRVNA_GPU_MODELS   which models, in order (default: "smollm2 smol host 1b"; absent ones skipped)
#   NRVNA_GPU_BENCHES  which benchmarks, in this order (default: "vs host models")
#   NRVNA_EMBED_GGUF   models.py's embedding model (default models/all-MiniLM-L6-v2-f16.gguf)
#   NRVNA_CUDA_FA      GGML_CUDA_FA: OFF builds no flash-attention kernels, in about half the time
#                      (default ON; both sides use the one build, and auto then means off)
#   PROMPTS, TOKENS, ROUNDS, SLOTS   the benchmark's size (default 64, 128, 3, "16,64")
#   HOST_PROMPTS, HOST_TOKENS        host_bound.py's size (default 256, 256)
#   MODELS_JOBS, MODELS_TOKENS       models.py's size: lines per model, tokens per chat line (default 50, 32)
#   PYTHON             the interpreter (default python3; it needs numpy, jinja2, diskcache, pyyaml)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
OUT=${1:-bench/gpu-results}
PYTHON=${PYTHON:-python3}
ARCH=${NRVNA_CUDA_ARCH:-native}
FA=${NRVNA_CUDA_FA:-ON}
BENCHES=${NRVNA_GPU_BENCHES:-vs host models}
CACHE=${NRVNA_BENCH_CACHE:-$HOME/.cache/nrvna-bench}/cuda-$VERSION-$ARCH$([ "$FA" = ON ] || echo -nofa)
for bench in $BENCHES; do
  case $bench in vs|host|models) ;; *) echo "gpu.sh: no benchmark named $bench (vs, host, models)" >&2; exit 2;; esac
done
VOCAB=${NRVNA_VOCAB_GGUF:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
mkdir -p "$OUT" "$CACHE"
say() { echo "gpu.sh: $*" >&2; }

# 1. The sdist: its Python package and its vendored llama.cpp.
if [ ! -d "$CACHE/sdist" ]; then
  sdist=${NRVNA_LLAMA_SDIST:-}
  tmp=$(mktemp -d)
  if [ -z "$sdist" ]; then
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp"
    sdist=$(ls "$tmp"/llama_cpp_python-$VERSION.tar.gz)
  fi
  if [ -d "$sdist" ]; then
    cp -r "$sdist" "$CACHE/sdist"
  else
    mkdir -p "$tmp/x" && tar -xf "$sdist" -C "$tmp/x"
    top=$(find "$tmp/x" -maxdepth 2 -type d -name llama_cpp -printf '%h\n' | head -1)
    mv "$top" "$CACHE/sdist"
  fi
  rm -rf "$tmp"
fi
SRC=$CACHE/sdist/vendor/llama.cpp

# 2. One CUDA build: shared libllama and libggml* for llama-cpp-python, and llama-server.
if [ ! -x "$CACHE/build/bin/llama-server" ]; then
  say "building llama.cpp with CUDA (arch $ARCH, flash attention $FA) on $(nproc) cores"
  start=$SECONDS
  cmake -S "$SRC" -B "$CACHE/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DGGML_CUDA_FA="$FA" -DBUILD_SHARED_LIBS=ON -DLLAMA_OPENSSL=OFF \
        -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_APP=OFF >"$OUT/build.log" 2>&1
  cmake --build "$CACHE/build" --target llama llama-server -j "$(nproc)" >>"$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log" >&2; exit 1; }
  say "built in $((SECONDS - start)) s"
fi
SITE=$CACHE/site
if [ ! -d "$SITE/llama_cpp" ]; then
  mkdir -p "$SITE"
  cp -r "$CACHE/sdist/llama_cpp" "$SITE/llama_cpp"
  rm -rf "$SITE/llama_cpp/lib"
  ln -s "$CACHE/build/bin" "$SITE/llama_cpp/lib"  # llama_cpp loads lib/libllama.so and lib/libggml*.so
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
"$PYTHON" -c "import llama_cpp, sys; sys.exit(not llama_cpp.llama_supports_gpu_offload())" \
  || { say "llama-cpp-python at $SITE does not offload to a GPU"; exit 1; }

# 3. Models.
mkdir -p "$CACHE/models"
models=()
for name in ${NRVNA_GPU_MODELS:-smollm2 smol host 1b}; do
  if [ "$name" = smollm2 ]; then
    [ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ] && models+=(models/SmolLM2-135M-Instruct.Q4_1.gguf)
    continue
  fi
  file=$CACHE/models/$name-v2.gguf  # v2: random_model.py draws the embedding whole (no tied logits)
  if [ ! -f "$file" ]; then
    "$PYTHON" bench/random_model.py "$VOCAB" "$file.part" --shape "$name" --gguf-py "$SRC/gguf-py"
    mv "$file.part" "$file"
  fi
  models+=("$file")
done

# 4. The benchmark, every layer on the GPU in every arm.
export NRVNA_GPU_LAYERS=-1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# A smoke test first: were nrvna to fail on this GPU, each arm would wait out its timeout.
smoke=$(mktemp -d)
"$PYTHON" nrvna.py daemon "${models[0]}" "$smoke/ws" >"$OUT/smoke.log" 2>&1 &
ids=$(for i in 1 2 3 4 5 6 7 8; do "$PYTHON" nrvna.py submit "$smoke/ws" "Count to $i." --max-tokens 32 --ignore-eos; done)
# shellcheck disable=SC2086
if ! "$PYTHON" nrvna.py wait "$smoke/ws" $ids --timeout 120 --quiet; then
  say "nrvna failed its smoke test on this GPU:"; tail -20 "$OUT/smoke.log" >&2; exit 1
fi
"$PYTHON" nrvna.py stop "$smoke/ws" >/dev/null
grep -i "gpu\|cuda\|offload" "$OUT/smoke.log" | head -5 >&2 || true
rm -rf "$smoke"
bench_vs() {  # nrvna against llama-server on each model
  for model in "${models[@]}"; do
    name=$(basename "$model" .gguf)
    model=$(realpath "$model")
    say "vs llama-server on $name"
    (cd bench && "$PYTHON" vs_llama_server.py --model "$model" --server "$CACHE/build/bin/llama-server" \
       --quick "${SLOTS:-16,64}" --prompts "${PROMPTS:-64}" --tokens "${TOKENS:-128}" --rounds "${ROUNDS:-3}") \
      2>&1 | tee "$OUT/vs-$name.txt"
  done
}
bench_host() {  # the host's work per token (issue 33): host_bound.py on the 1-layer model, profiled
  [ -f "$CACHE/models/host-v2.gguf" ] || { say "host_bound.py skipped: it needs the host model (NRVNA_GPU_MODELS)"; return; }
  say "host_bound.py on the 1-layer model"
  (cd bench && "$PYTHON" host_bound.py --model "$CACHE/models/host-v2.gguf" --server "$CACHE/build/bin/llama-server" \
     --slots "${SLOTS:-16,64}" --prompts "${HOST_PROMPTS:-256}" --tokens "${HOST_TOKENS:-256}" --rounds "${ROUNDS:-3}") \
    2>&1 | tee "$OUT/host-bound.txt"
}
bench_models() {  # several models (issue 31): models.py against llama-server's router, the chat models `smol`
  local embed
  embed=$(realpath -m "${NRVNA_EMBED_GGUF:-models/all-MiniLM-L6-v2-f16.gguf}")
  if [ ! -f "$CACHE/models/smol-v2.gguf" ] || [ ! -f "$embed" ]; then
    say "models.py skipped: it needs the smol model (NRVNA_GPU_MODELS) and $embed"; return
  fi
  say "models.py: three models against llama-server's router"
  (cd bench && "$PYTHON" models.py --chat "$CACHE/models/smol-v2.gguf" --embed "$embed" \
     --jobs "${MODELS_JOBS:-50}" --tokens "${MODELS_TOKENS:-32}" --server "$CACHE/build/bin/llama-server") 2>&1 | tee "$OUT/models.txt"
}
failed=0
for bench in $BENCHES; do  # one that fails is said, and the next still runs
  "bench_$bench" || { say "$bench failed"; failed=1; }
done
exit $failed
