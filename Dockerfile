# Container images of inference-service (CPU).
#   server (the default):  docker build -t inference-service:0.1.0 .
#     no models inside: deploy/kubernetes/deployment.yaml fills /models with its fetch-models
#     initContainer (this image's `python -m inference_service.launch.fetch_models`), or mount a store at /models.
#   with-models:           docker build --target with-models --build-arg MODEL_STORE=model_store \
#                              -t inference-service:0.1.0-models .
#     the archives of MODEL_STORE (a directory in the build context) baked in at /models, for
#     deploy/kubernetes/baked-models/deployment.yaml. Archives must be self-contained (an archive
#     that names a directory of the build machine, as scripts/build_llm_archive's does, will not load).
FROM python:3.11-slim AS server

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

WORKDIR /opt/inference-service
COPY requirements.txt constraints.txt pyproject.toml README.md ./
COPY src ./src
# torch==2.13.0 (constraints.txt) as the CPU wheel from PyTorch's index
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu -c constraints.txt -r requirements.txt \
    && pip install --no-deps .

RUN useradd --create-home --uid 10001 serve
USER 10001
WORKDIR /home/serve
# gRPC inference, gRPC management (loopback unless configured), HTTP inference, metrics
EXPOSE 7070 7071 8080 8082
ENTRYPOINT ["inference-service", "--foreground"]
CMD ["--model-store", "/models", "--models", "all"]

FROM server AS with-models
ARG MODEL_STORE=model_store
COPY --chown=10001:10001 ${MODEL_STORE}/ /models/

# the default target: the server without models
FROM server
