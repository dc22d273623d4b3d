# GPU image for SFT, RL and verify. RL colocates megatron-core training with vLLM, so one
# environment holds both: vLLM (extra `gpu-infer`) brings its torch, then megatron-core,
# TransformerEngine and fla (extra `gpu-train`) are added against that torch. Every pin lives
# in pyproject.toml; the only version here is the CUDA base image.
# Build from the repository root:  docker build -f dockerfiles/gpu.Dockerfile -t megabase-gpu .
# Not built in CI (no Docker engine or GPU there): written against the documented installs.
ARG CUDA_IMAGE=nvidia/cuda:12.9.1-cudnn-devel-ubuntu24.04
FROM ${CUDA_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git \
 && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
RUN python3 -m venv $VIRTUAL_ENV && pip install --no-cache-dir --upgrade pip
WORKDIR /root/megabase
COPY pyproject.toml README.md ./
COPY tasks tasks
COPY workflows workflows
COPY model model
COPY kernels kernels
# 1) vLLM and its torch; 2) the training extras built against that torch (TransformerEngine
#    compiles its torch extension, hence --no-build-isolation); 3) megabase itself.
RUN pip install --no-cache-dir -e '.[gpu-infer]' \
 && python3 -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/torch.txt \
 && pip install --no-cache-dir --no-build-isolation -c /tmp/torch.txt -e '.[gpu-infer,gpu-train]' \
 && python3 -c "import torch, vllm, megatron.core, fla, transformer_engine; print('megabase gpu image:', torch.__version__)"
