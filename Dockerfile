# syntax=docker/dockerfile:1
# kvrouter container: a multi-stage build on the slim Python image.
#   docker build -t kvrouter .
#   docker run -p 8000:8000 -v "$PWD/router.yaml:/etc/kvrouter/config.yaml:ro" kvrouter
# The config is read from /etc/kvrouter/config.yaml (mount a file or a ConfigMap there); the data
# port listens on 0.0.0.0:8000 in the container. See docs/deploy.md.
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# -- build: install kvrouter and its dependencies into a self-contained virtualenv ------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/kvrouter
COPY pyproject.toml README.md ./
COPY kvrouter ./kvrouter
COPY router ./router
COPY policies ./policies
COPY metrics ./metrics
COPY sglang_protocol ./sglang_protocol
COPY loadtest ./loadtest
RUN /opt/kvrouter/bin/pip install --no-cache-dir . \
 && /opt/kvrouter/bin/kvrouter --help > /dev/null

# -- runtime: the virtualenv only, run as an unprivileged user ------------------------------
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="kvrouter" \
      org.opencontainers.image.description="KV-cache-aware L7 router for SGLang replicas" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 kvrouter \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvrouter \
 && mkdir -p /etc/kvrouter
COPY --from=build /opt/kvrouter /opt/kvrouter
ENV PATH=/opt/kvrouter/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 8000
# Liveness of the process itself (/health); readiness (/ready: a healthy replica) is for the
# orchestrator's readiness probe, not for restarting the container.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["kvrouter"]
CMD ["serve", "--config", "/etc/kvrouter/config.yaml", "--host", "0.0.0.0", "--port", "8000"]
