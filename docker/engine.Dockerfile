# The inference engine: one container per GPU. `docker build -f docker/engine.Dockerfile .`
# The base image brings CUDA, cuDNN, torch and Triton; the engine's other pinned dependencies go on top
# (torch itself is kept from the image so its CUDA build is the one used).
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY requirements/engine.txt requirements/engine.txt
RUN grep -v '^torch==' requirements/engine.txt > /tmp/engine-requirements.txt \
    && pip install --no-cache-dir -r /tmp/engine-requirements.txt \
    && python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
COPY pyproject.toml ./
COPY kernels/ kernels/
COPY adapters/ adapters/
COPY engine/ engine/
RUN useradd --create-home quilt && mkdir -p /app/var/usage /app/var/usage-spool /app/var/adapter-cache && chown -R quilt /app/var
USER quilt
EXPOSE 8100
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import os, urllib.request as u; u.urlopen(u.Request('http://127.0.0.1:8100/v1/health', headers={'Authorization': 'Bearer ' + os.environ['QUILT_ENGINE_TOKEN']}), timeout=4)"
# Model and adapter store come from volumes; QUILT_ENGINE_TOKEN and CELERY_BROKER_URL from the environment.
ENTRYPOINT ["python", "-m", "engine"]
CMD ["--model", "/models/base", "--device", "cuda", "--host", "0.0.0.0", "--port", "8100", \
     "--adapter-store", "/data/media/adapters", "--usage-spool", "/app/var/usage/engine.jsonl"]
