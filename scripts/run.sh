#!/usr/bin/env bash
# One entry point that sets itself up: installs what is missing (idempotently), then runs.
#   bash scripts/run.sh train [hydra overrides...]   # train (default: digits + MLP, ~1 min)
#   bash scripts/run.sh test  [pytest args...]       # the test suite (default tier: not slow, not gpu)
#   bash scripts/run.sh setup                        # only install
# PYTHON=/path/to/python picks the interpreter (default: python3). Use a virtualenv if you prefer: activate it first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export DS_ACCELERATOR="${DS_ACCELERATOR:-$( (command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1) && echo cuda || echo cpu)}"

have_all() {  # every runtime (and test) dependency importable and lit_speed installed from this checkout
  "$PY" - "$@" <<'PYCHECK' >/dev/null 2>&1
import importlib.util, importlib.metadata as md, sys
mods = ["torch", "lightning", "deepspeed", "torchmetrics", "hydra", "psutil", "rich", "sklearn", "matplotlib", "ninja"]
extras = ",".join(sys.argv[1:]).split(",")
if "test" in extras:
    mods += ["pytest", "pytest_timeout", "pytest_rerunfailures", "tensorboard", "hydra_plugins.hydra_optuna_sweeper", "ruff"]
if "finetune" in extras:
    mods += ["transformers", "peft", "safetensors", "tokenizers", "torchao", "datasets"]
for m in mods:  # find, do not import: importing torch + deepspeed costs seconds
    if importlib.util.find_spec(m) is None:
        raise SystemExit(f"missing {m}")
md.version("lit_speed")
PYCHECK
}

setup() {
  local extras="$1"
  if have_all "$extras"; then return 0; fi
  echo "[lit_speed] installing what is missing (once)..."
  "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    if [ "$DS_ACCELERATOR" = "cuda" ]; then
      "$PY" -m pip install "torch>=2.4,<2.15"          # a CUDA build for GPU machines
    else
      "$PY" -m pip install "torch==2.13.0"             # CPU machines: pin, or pip pulls a multi-GB CUDA build
    fi
  fi
  "$PY" -m pip install -e ".[$extras]"
  have_all "$extras" || { echo "[lit_speed] set-up failed: see the pip output above" >&2; exit 1; }
}

cmd="${1:-train}"; shift || true
case "$cmd" in
  setup) setup "test,sweep,finetune" ;;
  train) setup "sweep,finetune"; exec "$PY" scripts/train.py "$@" ;;
  test)  setup "test,sweep,finetune"; exec "$PY" -m pytest "$@" ;;
  *) echo "usage: bash scripts/run.sh {train|test|setup} [args...]" >&2; exit 2 ;;
esac
