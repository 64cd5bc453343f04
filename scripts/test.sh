#!/usr/bin/env bash
# The test command (README, CI). Installs fledge, builds the vLLM CPU venv once (cached) for
# the real-engine tests, and runs every test, slow ones included.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[test]'
bash scripts/setup_vllm.sh
export FLEDGE_REQUIRE_VLLM=1
# Two processes, one per core: most tests run one torch thread. The vLLM tests share their
# servers, so they stay on one process (conftest groups them; loadgroup keeps a group together).
python3 -m pytest -q -ra --durations=15 -n 2 --dist loadgroup "$@"
