# uibus container image: `docker build -t uibus .` then `docker run -p 26040:26040 -p 8080:8080 uibus`.
# Two stages so the image carries no compiler or grpcio-tools: protos are compiled into the wheel.
FROM python:3.11-slim AS build
WORKDIR /src
# What the build reads: setup.py generates uibus.pb from protos/ (server/pb is in .dockerignore).
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY protos protos
COPY server server
COPY clients clients
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/uibus --create-home uibus
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER 10001:10001
WORKDIR /var/lib/uibus
# Bind every interface: probes and other containers reach the pod/container address, not loopback.
ENV UIBUS_HOST=0.0.0.0 \
    UIBUS_PORT=26040 \
    UIBUS_HTTP_PORT=8080 \
    UIBUS_STORE=/var/lib/uibus/uibus.db \
    PYTHONUNBUFFERED=1
VOLUME ["/var/lib/uibus"]
EXPOSE 26040 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 CMD ["python", "-c", "import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; ch = grpc.insecure_channel('127.0.0.1:26040'); sys.exit(0 if g.HealthStub(ch).Check(h.HealthCheckRequest(), timeout=2).status == h.HealthCheckResponse.SERVING else 1)"]
# SIGTERM -> NOT_SERVING, drain, end streams, flush the store, exit 0 (uibus serve handles it).
STOPSIGNAL SIGTERM
CMD ["uibus", "serve"]
