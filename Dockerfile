# uibus container image, tagged with this checkout's version (.ci/version; docs/operations.md):
#   docker build --build-arg VERSION=$(.ci/version) -t uibus:$(.ci/version --tag) .
# BuildKit (the default builder of current Docker; `DOCKER_BUILDKIT=1` for the 20.10 CLI).
# Two stages so the image carries no compiler or grpcio-tools: protos are compiled into the wheel.
# The base is pinned to a patch release so a rebuild gets the same Python; move it on purpose, for
# both stages at once, e.g. `docker build --build-arg BASE=python:3.11.17-slim-bookworm@sha256:<digest> .`.
ARG BASE=python:3.11.17-slim-bookworm
# The version this image is (`--build-arg VERSION=$(.ci/version)`, e.g. 0.1.1.dev5+g1a2b3c4): the build
# context has no .git, so setuptools-scm is told it, and the package, `uibus --version`,
# uibus_build_info and the OCI label below all say the same. Without it, pyproject.toml's
# fallback_version, which says "not a release" (tests/test_release.py keeps them equal).
ARG VERSION=0+unknown

FROM ${BASE} AS build
WORKDIR /src
# Every dependency at requirements.lock's exact version, as wheels, in a layer of its own (a code
# change does not download them again). Only this stage reaches the network: a proxy's CA bundle,
# if the build needs one, comes as a BuildKit secret (`docker build --secret id=ca,src=ca.pem`),
# mounted for these two RUNs only and never stored in any layer of either stage.
COPY requirements.lock ./
RUN --mount=type=secret,id=ca,required=false \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    pip wheel --no-cache-dir --no-deps --wheel-dir /wheels -r requirements.lock
# What the build reads: setup.py generates uibus.pb from protos/ (server/pb is in .dockerignore).
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY protos protos
COPY server server
COPY clients clients
# Declared here, not at the top of the stage: a RUN after an ARG misses the cache when its value
# changes, and every commit is a new version; the dependency wheels above stay cached.
ARG VERSION
RUN --mount=type=secret,id=ca,required=false \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    SETUPTOOLS_SCM_PRETEND_VERSION_FOR_UIBUS="${VERSION}" pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE}
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/uibus --create-home uibus
# From the build stage's wheels only (--no-index): the exact versions CI tested with, no network,
# no CA; `pip check` fails the build if the lock no longer satisfies uibus.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index /wheels/*.whl && pip check
# After the installs, for the same reason as in the build stage (tests/test_container.py checks the
# label against `uibus --version` in the image and its uibus_build_info).
ARG VERSION
LABEL org.opencontainers.image.title="uibus" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
USER 10001:10001
WORKDIR /var/lib/uibus
# Bind every interface: probes and other containers reach the pod/container address, not loopback.
# So uibus serves only with a token (it exits 2 without one, docs/security.md):
#   docker run -e UIBUS_AUTH_TOKEN=$(openssl rand -hex 32) -p 26040:26040 -p 8080:8080 uibus:$(.ci/version --tag)
ENV UIBUS_HOST=0.0.0.0 \
    UIBUS_PORT=26040 \
    UIBUS_HTTP_PORT=8080 \
    UIBUS_STORE=/var/lib/uibus/uibus.db \
    PYTHONUNBUFFERED=1
# The only writable path it needs (a read-only root filesystem is fine; mount /tmp too).
VOLUME ["/var/lib/uibus"]
EXPOSE 26040 8080
# gRPC health of "" on the port uibus serves: follows UIBUS_PORT when `docker run -e UIBUS_PORT=…` moves it.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 CMD ["python", "-c", "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; ch = grpc.insecure_channel('127.0.0.1:' + os.environ['UIBUS_PORT']); sys.exit(0 if g.HealthStub(ch).Check(h.HealthCheckRequest(), timeout=2).status == h.HealthCheckResponse.SERVING else 1)"]
# SIGTERM -> NOT_SERVING, drain, end streams, flush the store, exit 0 (uibus serve handles it).
STOPSIGNAL SIGTERM
CMD ["uibus", "serve"]
