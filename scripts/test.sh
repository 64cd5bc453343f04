#!/usr/bin/env bash
# The test command (README, CI). Installs fledge, builds the vLLM CPU venv once (cached) for
# the real-engine tests, and runs every test, slow ones included.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[test]'
bash scripts/setup_vllm.sh
export FLEDGE_REQUIRE_VLLM=1
python3 -m pytest -q -ra --durations=15 "$@"
