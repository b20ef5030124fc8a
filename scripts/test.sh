#!/usr/bin/env bash
# Set up (idempotent), then run the whole test suite. GPU tests skip cleanly without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
exec ${PYTHON:-python3} -m pytest tests -q -p no:cacheprovider "$@"
