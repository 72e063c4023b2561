#!/usr/bin/env bash
# Builds the llama.cpp peer from the sources vendored in PyPI llama-cpp-python 0.3.36.
#
#   scripts/build-peer.sh           llama-bench, llama-batched-bench, llama-server and
#                                   the oracle's tools: side-by-side benchmarks
#   scripts/build-peer.sh oracle    llama-quantize, llama-gguf-split and libllama only:
#                                   what the tests need to make files and compute
#                                   llama.cpp's logits
#
# libllama is loaded by the package's own ctypes bindings (the sdist's `llama_cpp`
# folder, with LLAMA_CPP_LIB_PATH pointing at the bin directory; see
# scripts/peer_logits.py), so no second compile of the same sources is needed.
# Built for the machine it runs on (GGML_NATIVE, as llama.cpp's own build does by
# default), so the peer uses every SIMD extension this CPU has and none it lacks; AMX
# off: llama.cpp's AMX matrix multiply crashes (SIGSEGV in ggml_backend_amx_mul_mat)
# on the Sapphire Rapids VMs we run on. GGML_AMX_*=OFF alone does not do it under
# GGML_NATIVE (-march=native turns AMX on again), so the compiler is told -mno-amx-*
# too, which wins over -march. A build made with other flags is made again.
# Idempotent; prints the bin directory on success.
set -euo pipefail
ver=0.3.36
root="${PDSERVE_PEER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pdserve/peer}"
bin="$root/build/bin"
case "${1:-all}" in
  all) targets=(llama-bench llama-batched-bench llama-server llama-quantize llama-gguf-split llama)
    isa=(-DGGML_NATIVE=ON) ;;
  # The oracle is one reference on every machine: AVX2 with FMA and F16C, whatever
  # else the CPU has. Built natively, its logits moved with the machine's ISA: at a
  # near-tie of SmolLM2 (Q6_K and IQ4_NL, fifth position) llama.cpp's AVX-512 build
  # picks the other token than its AVX2 build, beyond the tests' 0.15 margin.
  oracle) targets=(llama-quantize llama-gguf-split llama) root="$root-oracle" bin="$root/build/bin"
    isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON) ;;
  *) echo "usage: $0 [oracle]" >&2; exit 2 ;;
esac
flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16 ${isa[*]}"
have=1
same_flags=1
[ "$(cat "$root/build/pdserve-flags" 2>/dev/null)" = "$flags" ] || { have=0; same_flags=0; }
for t in "${targets[@]}"; do
  case $t in llama) f="$bin/libllama.so" ;; *) f="$bin/$t" ;; esac
  [ -e "$f" ] || have=0
done
if [ "$have" = 1 ]; then echo "$bin"; exit 0; fi
mkdir -p "$root"
python3 -m pip install -q --disable-pip-version-check cmake ninja scikit-build-core >&2
if [ ! -f "$root/llama_cpp_python-$ver.tar.gz" ]; then
  python3 -m pip download -q --no-deps --no-binary=:all: --no-build-isolation \
    -d "$root" "llama-cpp-python==$ver" >&2
fi
if [ ! -d "$root/src/vendor" ]; then
  mkdir -p "$root/src"
  tar -xzf "$root/llama_cpp_python-$ver.tar.gz" -C "$root/src" --strip-components=1
fi
# A build made with other flags starts over, configuration included.
[ "$same_flags" = 1 ] || rm -rf "$root/build"
# The ninja of this run: a cached path may be a deleted clone's virtual environment.
cmake -S "$root/src/vendor/llama.cpp" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_MAKE_PROGRAM="$(command -v ninja)" \
  -DBUILD_SHARED_LIBS=ON -DCMAKE_RUNTIME_OUTPUT_DIRECTORY="$bin" -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$bin" \
  "${isa[@]}" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_OPENMP=OFF \
  -DCMAKE_C_FLAGS="${flags%% -D*}" -DCMAKE_CXX_FLAGS="${flags%% -D*}" \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$root/build" -j "$(nproc)" --target "${targets[@]}" >&2
echo "$flags" >"$root/build/pdserve-flags"
echo "$bin"
