# voxmill CPU image: workers, the model watcher and, built with EXTRAS=monitor, Flower.
#
#   docker build -t voxmill:cpu .
#   docker run --rm -e VOXMILL_BROKER_URL=redis://:PASSWORD@redis-host:6379/0 \
#       -v "$PWD/models:/models:ro" -v "$PWD/data:/data" voxmill:cpu worker -Q embed
#
# docker-compose.yml builds it for the `worker-cpu`, `watcher` and `flower` services.
FROM python:3.11-slim-bookworm

# Extra dependency groups of pyproject.toml to install, e.g. "monitor" (Flower).
ARG EXTRAS=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VOXMILL_PROVIDER=cpu \
    VOXMILL_MODEL_DIR=/models \
    VOXMILL_ALLOWED_ROOTS=/data \
    VOXMILL_ENGINE_CACHE_DIR=/cache/engines

WORKDIR /app

# Dependencies first, from pyproject.toml alone, so a code change does not reinstall them.
# The install is editable because voxmill reads config/ (settings, model registry) from
# its source tree.
COPY pyproject.toml README.md ./
RUN mkdir pipeline workers \
 && touch pipeline/__init__.py workers/__init__.py \
 && pip install -e ".${EXTRAS:+[$EXTRAS]}"
COPY config ./config
COPY pipeline ./pipeline
COPY workers ./workers

# Never run as root. /data (corpora, outputs) and /cache belong to this user; /models is
# mounted read-only.
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/voxmill voxmill \
 && mkdir -p /models /data /cache/engines /cache/ort \
 && chown -R voxmill:voxmill /data /cache \
 && chmod 700 /cache/ort
USER voxmill
WORKDIR /data

ENTRYPOINT ["voxmill"]
CMD ["worker", "-Q", "tokenize,embed,extract"]
