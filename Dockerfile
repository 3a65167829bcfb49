# The one image the control plane, the Ray head and the Ray workers run: the official Ray
# image of the Ray version this project pins (pyproject.toml: ray==2.60.0), with this
# project installed. RAY_TAG picks the variant: 2.60.0-py311-cpu (dev overlay) or
# 2.60.0-py311-gpu (CUDA; gpu overlay). Build with
#   docker build -t REGISTRY/pstar:0.1.0-ray2.60.0-py311-cpu .
#   docker build --build-arg RAY_TAG=2.60.0-py311-gpu -t REGISTRY/pstar:0.1.0-ray2.60.0-py311-gpu .
ARG RAY_TAG=2.60.0-py311-cpu
FROM rayproject/ray:${RAY_TAG}

# a C++ compiler for the host AdamW kernel, built below for the image's CPU, and WordNet
# for the METEOR grader's synonyms (distribution packages follow the base image's
# release, so they are not pinned one by one)
USER 0
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ ninja-build wordnet-base \
    && rm -rf /var/lib/apt/lists/*
USER 1000

# torch first and pinned: the CPU image takes the CPU wheel, the GPU image the CUDA one
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir "torch==2.13.0" --index-url "${TORCH_INDEX}"

WORKDIR /opt/pstar
COPY --chown=1000:100 pyproject.toml README.md ./
COPY --chown=1000:100 pstar_core ./pstar_core
COPY --chown=1000:100 service ./service
COPY --chown=1000:100 api ./api
COPY --chown=1000:100 benchmarks ./benchmarks
COPY --chown=1000:100 pstar ./pstar
RUN pip install --no-cache-dir .

# the Ray image's unprivileged user (uid 1000); the manifests run every pod as non-root
USER 1000
ENV PSTAR_DATA_DIR=/data
# The AdamW kernel built (-march=native) and the faster host kernel chosen for the CPU the
# image is built on, so no job compiles inside its first step; a node with another CPU
# type builds its own once, before its job trains, and the job says so in an event.
ENV PSTAR_EXT_DIR=/opt/pstar/ext
RUN pstar kernels
EXPOSE 8000
CMD ["pstar", "serve", "--host", "0.0.0.0", "--port", "8000"]
