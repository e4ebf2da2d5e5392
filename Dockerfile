# syntax=docker/dockerfile:1
# latentserve GPU image, for linux/amd64 and linux/arm64 (GB200's Grace CPUs):
#   docker buildx build --platform linux/amd64,linux/arm64 -t REGISTRY/latentserve:0.1.0 --push .
#   docker run --gpus all --shm-size 16g -p 8000:8000 REGISTRY/latentserve:0.1.0 \
#     --model tiny --tp 1 --device cuda --host 0.0.0.0 --port 8000
#
# Base: CUDA 13.0's "base" flavour. torch==2.13.0 (requirements-cuda.txt) is built for
# CUDA 13.0 and installs cuBLAS, cuDNN and NCCL as pinned pip packages, so the image needs
# only what "base" adds to Ubuntu: the CUDA forward-compatibility package and the NVIDIA
# container-runtime variables. A "runtime" or "devel" base would carry a second, unpinned
# copy of those libraries. The driver comes from the host (>= 580 for CUDA 13).
# For a bit-for-bit rebuild pin the digest as well: --build-arg CUDA_IMAGE=nvidia/cuda:...@sha256:...
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04
FROM ${CUDA_IMAGE}

# Ubuntu 24.04's Python is 3.12 (the project needs >= 3.11). gcc, libc6-dev and python3-dev:
# Triton compiles its kernel launchers with the system C compiler at run time. wget: KubeRay's
# default worker probes call it.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev gcc libc6-dev ca-certificates wget \
 && rm -rf /var/lib/apt/lists/*

# The image's user: a fixed numeric uid so Kubernetes can check runAsNonRoot (the Helm chart
# runs as 10001:10001). Ubuntu's own uid 1000 ("ubuntu") is left alone.
RUN groupadd --gid 10001 latentserve \
 && useradd --uid 10001 --gid 10001 --create-home --shell /bin/bash latentserve

# The same install as the README, with the CUDA requirements file and a non-editable
# install: a venv, then the pinned requirements and the package in one pip command.
# The venv stays root-owned: the service cannot modify its own code.
WORKDIR /opt/latentserve/src
COPY pyproject.toml README.md requirements.txt requirements-cuda.txt ./
COPY service/ ./service/
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv /opt/latentserve/venv \
 && /opt/latentserve/venv/bin/pip install -r requirements-cuda.txt .

# Login shells (KubeRay's `bash -l` init containers) reset PATH from /etc/profile; put the
# venv back in front for them too.
RUN echo 'export PATH=/opt/latentserve/venv/bin:$PATH' > /etc/profile.d/10-latentserve.sh

# NVLink multicast off (NCCL, PyTorch symmetric memory, NVSHMEM): multicast buffers live
# outside latentserve's pool, so /sleep cannot release them; the fused tail is unicast by
# design; and a leaked multicast object can leave the GPUs unusable until reset.
ENV PATH=/opt/latentserve/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1 \
    LATENTSERVE_HEALTH_URL=http://127.0.0.1:8000/health

USER 10001:10001
WORKDIR /home/latentserve
EXPOSE 8000

# Model loading can take minutes; set LATENTSERVE_HEALTH_URL when serving on another port.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
  CMD python3 -c "import os, urllib.request; urllib.request.urlopen(os.environ['LATENTSERVE_HEALTH_URL'], timeout=4)" || exit 1

ENTRYPOINT ["latentserve", "serve"]
# Arguments given to `docker run` replace these whole: repeat --host 0.0.0.0 and --device cuda.
CMD ["--model", "tiny", "--tp", "1", "--device", "cuda", "--host", "0.0.0.0", "--port", "8000"]
