# Container image of inference-service (CPU). Build: docker build -t inference-service:0.1.0 .
# Models are not baked in: mount a model store at /models (see deploy/kubernetes/).
FROM python:3.11-slim

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
EXPOSE 7070 7071
ENTRYPOINT ["inference-service", "--foreground"]
CMD ["--model-store", "/models", "--models", "all"]
