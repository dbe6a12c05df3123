#!/usr/bin/env bash
# The GPU kit, assembled on a CPU machine (docs/gpu.md): wheels a bare GPU machine lacks, into .gpu_kit/.
#   scripts/gpu_kit.sh [--dry-run]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="${PYTHON:-python3}"
[ -x "$here/../.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && py="$here/../.venv/bin/python"
exec "$py" "$here/gpu_kit.py" "$@"
