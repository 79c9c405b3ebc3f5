# syntax=docker/dockerfile:1
# Build stage: build a wheel of kvrouter and its dependencies.
FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvrouter ./kvrouter
COPY router ./router
COPY policies ./policies
COPY metrics ./metrics
COPY loadtest ./loadtest
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# Runtime stage: slim, non-root, config mounted at /etc/kvrouter/config.yaml.
FROM python:3.12-slim
RUN useradd --system --uid 10001 --no-create-home kvrouter
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=2s --retries=3 \
  CMD ["python", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]
ENTRYPOINT ["kvrouter"]
CMD ["serve", "--config", "/etc/kvrouter/config.yaml", "--host", "0.0.0.0"]
