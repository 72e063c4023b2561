#!/usr/bin/env bash
# Builds the llama.cpp peer (llama-bench, llama-batched-bench, llama-server) from the
# sources vendored in PyPI llama-cpp-python 0.3.36, for side-by-side benchmarks.
# AVX-512 on, AMX off: llama.cpp's AMX path crashes on some of the machines we run
# on. Idempotent; prints the bin directory on success.
set -euo pipefail
ver=0.3.36
root="${PDSERVE_PEER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pdserve/peer}"
bin="$root/build/bin"
if [ -x "$bin/llama-bench" ] && [ -x "$bin/llama-batched-bench" ] && [ -x "$bin/llama-server" ]; then
  echo "$bin"; exit 0
fi
mkdir -p "$root"
python3 -m pip install -q cmake ninja scikit-build-core >&2
if [ ! -f "$root/llama_cpp_python-$ver.tar.gz" ]; then
  python3 -m pip download -q --no-deps --no-binary=:all: --no-build-isolation \
    -d "$root" "llama-cpp-python==$ver" >&2
fi
if [ ! -d "$root/src" ]; then
  mkdir -p "$root/src"
  tar -xzf "$root/llama_cpp_python-$ver.tar.gz" -C "$root/src" --strip-components=1
fi
cmake -S "$root/src/vendor/llama.cpp" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_OPENMP=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$root/build" -j "$(nproc)" --target llama-bench llama-batched-bench llama-server >&2
echo "$bin"
