#!/usr/bin/env bash
# The GPU checks from the kit (docs/gpu.md), on a bare GPU machine:
#   OUT=/folder scripts/gpu_check.sh PART [PART ...]      PART: cost loops methods aa lossless compiled study all
#   OUT=/folder scripts/gpu_check.sh PART --cpu           the harness on a CPU with tiny models
# Python: $PYTHON, else the project's .venv for --cpu, else python3 (the GPU image's, which holds torch).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="${PYTHON:-python3}"
case " $* " in
  *" --cpu "*) [ -z "${PYTHON:-}" ] && [ -x "$here/../.venv/bin/python" ] && py="$here/../.venv/bin/python" ;;
esac
exec "$py" "$here/gpu_check.py" "$@"
