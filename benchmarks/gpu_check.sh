#!/usr/bin/env bash
# The CUDA paths on a real GPU in one run (issue 37): install what is missing, then
# `python -m benchmarks.gpu_check "$@"` (every test marked cuda, the GPU benchmark, a JSON
# of figures and a verdict). The install counts against --budget-s (default 480 s).
#
# Which Python: $PYTHON if set, else .venv/bin/python, else a new .venv (python3 -m venv).
# Which torch:
#   - the interpreter's own torch when it has one and it fits the machine (a torch built
#     with CUDA where `nvidia-smi -L` lists a GPU; any torch where none is listed): nothing
#     is installed, so a machine without network access runs what it has;
#   - otherwise $CHECKPOINTD_TORCH (default torch==2.13.0, the version CI pins) from
#     $CHECKPOINTD_TORCH_INDEX: with a GPU, default the public index (PyPI's Linux wheel is
#     the CUDA build; give e.g. https://download.pytorch.org/whl/cu128 for another CUDA);
#     without one, default https://download.pytorch.org/whl/cpu (never a plain `torch`,
#     which would pull the multi-GB CUDA build onto a CPU machine).
# Then the project with its test extra if checkpointd or pytest is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)

if [[ -z "${PYTHON:-}" ]]; then
    [[ -x .venv/bin/python ]] || python3 -m venv .venv
    PYTHON=.venv/bin/python
fi
gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    gpu=1
fi

fits=$("$PYTHON" - "$gpu" <<'EOF' 2>/dev/null || echo no
import sys
try:
    import torch
except ImportError:
    print("no")
else:
    print("yes" if sys.argv[1] == "0" or torch.version.cuda is not None else "no")
EOF
)
if [[ "$fits" != yes ]]; then
    spec=${CHECKPOINTD_TORCH:-torch==2.13.0}
    if [[ $gpu == 1 ]]; then
        index=${CHECKPOINTD_TORCH_INDEX:-}
    else
        index=${CHECKPOINTD_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
    fi
    echo "gpu_check.sh: installing $spec${index:+ from $index} (GPU listed: $gpu)"
    # --force-reinstall: a CPU build of the same version (2.13.0+cpu) satisfies ==2.13.0.
    "$PYTHON" -m pip install --quiet --force-reinstall ${index:+--index-url "$index"} "$spec"
fi
if ! "$PYTHON" -c "import checkpointd, pytest, xdist" >/dev/null 2>&1; then
    echo "gpu_check.sh: installing the project with its test extra"
    "$PYTHON" -m pip install --quiet -e '.[test]'
fi
exec "$PYTHON" -m benchmarks.gpu_check --started "$started" "$@"
