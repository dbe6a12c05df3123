#!/usr/bin/env bash
# Inference engines the tuner measures (engine=llamacpp), built from source that the package
# registry carries, into a cache outside the checkout.
#
#   scripts/engines.sh llamacpp        build llama-server + llama-quantize (a no-op when cached)
#   scripts/engines.sh path llamacpp   print the cached build's bin/ folder (exit 1: not built)
#
# llama.cpp: the source bundled in the PyPI sdist of llama-cpp-python (pinned version, sha256
# checked), CPU backend, GGML_NATIVE=ON (the host's instruction set). The cache key holds the
# sdist version, the CPU's instruction-set flags and the compiler version, so a cached binary is
# only reused on a CPU that can run it (AMD EPYC and Intel AVX-512 machines get their own).
# Nothing is fetched during the build: the web UI is neither downloaded nor built (the server's
# API is all the tuner uses), OpenSSL is off, tests and examples are not built.
# Settings (environment): SPECTUNE_ENGINES (cache root, default ~/.cache/spectune/engines),
# SPECTUNE_BUILD_JOBS (default: nproc).
set -euo pipefail

LLAMACPP_SDIST=llama-cpp-python
LLAMACPP_VERSION=0.3.36                  # bundles llama.cpp commit 0c1e570 (ggml 0.25.3)
LLAMACPP_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMACPP_COMMIT=0c1e570
CACHE=${SPECTUNE_ENGINES:-$HOME/.cache/spectune/engines}
JOBS=${SPECTUNE_BUILD_JOBS:-$(nproc)}

cpu_key() {   # instruction-set flags + compiler: what the native build depends on
  { grep -m1 '^flags' /proc/cpuinfo || uname -m; gcc --version | head -n1; } \
    | sha256sum | cut -c1-12
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
  echo "engines: building llama-server and llama-quantize with $JOBS jobs (a few minutes)"
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
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
 "cmake_flags": "GGML_NATIVE=ON BUILD_SHARED_LIBS=OFF LLAMA_BUILD_UI=OFF LLAMA_USE_PREBUILT_UI=OFF LLAMA_OPENSSL=OFF",
 "jobs": $JOBS, "build_seconds": $seconds,
 "llama_server_sha256": "$(sha256sum "$dir.tmp/bin/llama-server" | cut -d' ' -f1)"}
JSON
  rm -rf "$dir" && mv "$dir.tmp" "$dir"       # the cache entry appears complete or not at all
  echo "engines: llama.cpp built in ${seconds} s -> $dir"
}

case "${1:-}" in
  llamacpp) build_llamacpp ;;
  path)
    [ "${2:-}" = llamacpp ] || { echo "usage: $0 path llamacpp" >&2; exit 2; }
    dir=$(llamacpp_dir)
    [ -x "$dir/bin/llama-server" ] || exit 1
    echo "$dir/bin" ;;
  *) echo "usage: $0 llamacpp | path llamacpp" >&2; exit 2 ;;
esac
