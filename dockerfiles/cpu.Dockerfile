# CPU image for the data stages (ingest, pack) and CPU runs of every stage.
# Build from the repository root:  docker build -f dockerfiles/cpu.Dockerfile -t megabase-cpu .
# Versions come from pyproject.toml through scripts/install.sh (the same install as README and CI).
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ git && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
RUN python -m venv $VIRTUAL_ENV
WORKDIR /root/megabase
COPY pyproject.toml README.md ./
COPY scripts scripts
COPY tasks tasks
COPY workflows workflows
COPY model model
COPY kernels kernels
RUN bash scripts/install.sh
