"""Structural checks of the deployment files (no Docker engine or cluster here): the probes are
native gRPC on the port uibus serves, the server binds every interface, every UIBUS_* setting is
a real config field with a value `uibus serve` accepts, and the compose front reaches both replicas.
Also: the manifests as `kubectl kustomize` renders them (PDB and HPA on the Deployment), the Ingress
example, the Redis Cluster and Sentinel overlays (their settings, no single-node Redis; each taken by
plain `kubectl kustomize` / `apply -k`, no load-restrictor flag anywhere), the image's
pinned base, lock file, version label and health check (run for real against a live app), one
compose build tagged with the package version, and nginx's `http2 on;`."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import free_port, require_binary
from uibus.app import App
from uibus.infra.config import Config

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAYS = K8S / "overlays"
# The Dockerfile's VERSION without a build argument: pyproject's fallback, "not a release"
# (tests/test_release.py). The k8s base deploys the last release (RELEASES' last line); compose builds
# and tags this checkout's version, which `.ci/version --env` gives it (compose refuses to start without).
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools_scm"]["fallback_version"]
RELEASE = [line.split()[0] for line in (REPO / "RELEASES").read_text().splitlines()
           if line.strip() and not line.startswith("#")][-1]
IMAGE = "uibus:${UIBUS_IMAGE_TAG:?set UIBUS_IMAGE_TAG and UIBUS_VERSION to what .ci/version --env prints}"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _k8s() -> list[dict[str, Any]]:
    return [d for p in sorted(BASE.glob("*.yaml")) if p.name != "kustomization.yaml" for d in _docs(p)]


def _one(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in _k8s() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}"
    return found[0]


def _config_from_env(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Config:
    """What `uibus serve` would build from these environment variables."""
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    parser = argparse.ArgumentParser()
    Config.add_arguments(parser)
    return Config.from_args(parser.parse_args([]))


def _check_env_names(env: dict[str, Any]) -> None:
    fields = {f"UIBUS_{name.upper()}" for name in Config.__dataclass_fields__}
    unknown = {k for k in env if k.startswith("UIBUS_")} - fields
    assert not unknown, f"not uibus settings (typo?): {sorted(unknown)}"


def test_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml"}


def test_k8s_deployment_probes_are_grpc_on_26040(monkeypatch: pytest.MonkeyPatch) -> None:
    dep = _one("Deployment", "uibus")
    assert "replicas" not in dep["spec"]  # the HPA owns it; a fixed count would fight it on every apply
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"uibus:{RELEASE}"
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == 26040, probe
        assert container[probe]["grpc"].get("service", "") == ""  # uibus reports "" NOT_SERVING on shutdown
        assert "httpGet" not in container[probe] and "exec" not in container[probe]
    assert {p["containerPort"] for p in container["ports"]} == {26040, 8080}
    assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()

    (ref,) = container["envFrom"]
    cm = _one("ConfigMap", ref["configMapRef"]["name"])
    _check_env_names(cm["data"])
    # A pod binds every interface, so it must have a token (uibus refuses to start without one): from
    # the Secret that the manifest's header (and the deployment docs) tell the operator to create.
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    ref_ = secrets["UIBUS_AUTH_TOKEN"]
    assert ref_.get("optional") is not True  # a missing Secret stops the pod, naming it
    create = f'kubectl create secret generic {ref_["name"]} --from-literal={ref_["key"]}="$(openssl rand -hex 32)"'
    assert create in (BASE / "uibus.yaml").read_text() and create in (REPO / "docs" / "deployment.md").read_text()
    with pytest.raises(ValueError, match="not a loopback address"):
        _config_from_env(cm["data"], monkeypatch)  # the ConfigMap alone: refused, as the pod would be
    cfg = _config_from_env({**cm["data"], "UIBUS_AUTH_TOKEN": "from-the-secret"}, monkeypatch)
    assert cfg.host == "0.0.0.0" and cfg.port == 26040 and cfg.http_port == 8080
    assert pod["terminationGracePeriodSeconds"] > cfg.drain_seconds + cfg.grace_seconds

    # Redis's URL is the Deployment's (it carries the password, from a Secret): test_redis_needs_a_password
    url = {e["name"]: e for e in container["env"]}["UIBUS_REDIS_URL"]["value"]
    redis_host = re.match(r"redis://:\$\(REDIS_PASSWORD\)@([^:/]+)", url)
    assert redis_host, url
    svc = _one("Service", redis_host.group(1))
    assert svc["spec"]["selector"].items() <= _one("Deployment", redis_host.group(1))["spec"]["template"][
        "metadata"]["labels"].items()


def test_k8s_service_targets_the_pods() -> None:
    svc = _one("Service", "uibus")
    labels = _one("Deployment", "uibus")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert {p["port"] for p in svc["spec"]["ports"]} == {26040, 8080}


def test_compose_two_replicas_on_redis_behind_front(monkeypatch: pytest.MonkeyPatch) -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    replicas = {name: s for name, s in services.items() if s.get("image") == IMAGE}
    assert len(replicas) == 2
    for name, svc in replicas.items():
        env = svc["environment"]
        _check_env_names(env)
        # The replicas bind every interface: the token is the operator's, required by compose itself.
        assert env["UIBUS_AUTH_TOKEN"].startswith("${UIBUS_AUTH_TOKEN:?"), name
        cfg = _config_from_env({**env, "UIBUS_AUTH_TOKEN": "set-by-the-operator",
                                "UIBUS_REDIS_URL": _compose_expand(env["UIBUS_REDIS_URL"], "pw")}, monkeypatch)
        assert cfg.host == "0.0.0.0", name
        assert cfg.redis_url == "redis://:pw@redis:6379/0", name
        assert "redis" in svc["depends_on"]
    front = services["front"]
    conf_path = front["volumes"][0].split(":")[0]
    conf = (REPO / conf_path).read_text()
    for name in replicas:
        assert f"server {name}:26040;" in conf and f"server {name}:8080;" in conf
    assert "grpc_pass grpc://" in conf and re.search(r"^\s*listen 26040;$", conf, re.MULTILINE)
    assert "proxy_buffering off;" in conf  # gRPC-Web server streams must not be buffered


def test_compose_builds_the_image_once_and_front_waits_for_healthy_replicas() -> None:
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    builders = {name: s for name, s in services.items() if "build" in s}
    (builder,) = builders.values()  # a second `build` of the same image would build it twice
    assert builder["image"] == IMAGE and builder["build"]["context"] == "."
    assert builder["build"]["args"]["VERSION"].startswith("${UIBUS_VERSION:?")
    assert builder.get("pull_policy") == "build"  # never a same-named image from a registry instead
    users = [s for name, s in services.items() if s.get("image") == IMAGE and name not in builders]
    assert users and all(s.get("pull_policy") == "never" for s in users)
    replicas = [name for name, s in services.items() if s.get("image") == IMAGE]
    # healthy = the image's HEALTHCHECK, unless a service brings (or disables) its own
    assert re.search(r"^HEALTHCHECK .*CMD", (REPO / "Dockerfile").read_text(), re.MULTILINE)
    for name in replicas:
        check = services[name].get("healthcheck", {})
        assert not check.get("disable") and check.get("test", ["CMD"]) != ["NONE"], name
    depends = services["front"]["depends_on"]
    assert {name: d["condition"] for name, d in depends.items()} == dict.fromkeys(replicas, "service_healthy")


def _default(value: str) -> str:
    """What a compose value is without its variable set: `${VAR:-default}` → default."""
    m = re.fullmatch(r"\$\{\w+:-(.+)\}", value)
    return m.group(1) if m else value


@pytest.mark.parametrize("version", ["1.27.0", "1.37.0"])
def test_k8s_manifests_validate_against_kubernetes_schemas(version: str) -> None:
    """Every manifest (the kustomization as kubectl builds it, and the examples) against the
    Kubernetes API schemas of the oldest supported and the newest release, strictly: a misspelt
    or misplaced field fails here rather than at `kubectl apply` time."""
    import kubernetes_validate

    kubectl = require_binary("kubectl")
    built = subprocess.run([kubectl, "kustomize", str(BASE)], capture_output=True, text=True, check=True, timeout=60)
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    docs += [d for p in sorted((K8S / "examples").glob("*.yaml")) for d in _docs(p)]
    assert len(docs) >= 8
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_nginx_uses_http2_on_not_the_deprecated_listen_parameter() -> None:
    conf = (REPO / "deploy" / "nginx" / "nginx.conf").read_text()
    code = "\n".join(line.split("#", 1)[0] for line in conf.splitlines())
    assert re.search(r"^\s*http2 on;", code, re.MULTILINE)
    assert not re.search(r"\blisten\s[^;]*\bhttp2\b", code), "`listen … http2` is deprecated since nginx 1.25.1"
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    image = _default(compose["services"]["front"]["image"])
    m = re.fullmatch(r"nginx:(\d+)\.(\d+)[\w.-]*", image)
    assert m and (int(m.group(1)), int(m.group(2))) >= (1, 25), f"{image}: `http2 on;` needs nginx 1.25.1"


def _dockerfile() -> str:
    return (REPO / "Dockerfile").read_text()


def test_dockerfile_pins_its_base_and_installs_the_lock() -> None:
    text = _dockerfile()
    base = re.search(r"^ARG BASE=(\S+)$", text, re.MULTILINE)
    assert base and re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", base.group(1)), "pin a patch release"
    froms = re.findall(r"^FROM (\S+)", text, re.MULTILINE)
    assert froms == ["${BASE}", "${BASE}"]  # both stages on the same Python
    # The build stage makes a wheel of every locked version (and of uibus); the final stage installs
    # only those, from no index: what CI tested, and no network (or CA bundle) in the final stage.
    assert re.search(r"pip wheel --no-cache-dir --no-deps --wheel-dir /wheels -r \S*requirements\.lock", text)
    assert re.search(r"pip wheel --no-cache-dir --no-deps --wheel-dir /wheels \.$", text, re.MULTILINE)
    assert re.search(r"pip install --no-cache-dir --no-index /wheels/\*\.whl && pip check", text)
    assert re.search(r"^COPY requirements\.lock ", text, re.MULTILINE)
    final = text[text.rindex("FROM ${BASE}"):]
    assert "id=ca" not in final, "the CA secret is for the build stage only"
    version = re.search(r"^ARG VERSION=(\S+)$", text, re.MULTILINE)
    assert version and version.group(1) == VERSION
    assert re.search(r'org\.opencontainers\.image\.version="\$\{VERSION\}"', text)
    assert re.search(r"^STOPSIGNAL SIGTERM$", text, re.MULTILINE)
    assert re.search(r"^USER 10001:10001$", text, re.MULTILINE)
    for path in (REPO / "Dockerfile", REPO / "docker-compose.yml", *sorted(K8S.rglob("*.yaml"))):
        assert not re.search(r":latest\b", path.read_text()), f"{path.name}: tag a version, not :latest"


def _healthcheck() -> list[str]:
    line = re.search(r"^HEALTHCHECK .*?CMD (\[.*\])$", _dockerfile(), re.MULTILINE)
    assert line, "no exec-form HEALTHCHECK"
    cmd = json.loads(line.group(1))
    assert cmd[0] == "python"
    return [sys.executable, *cmd[1:]]


async def _run_check(port: int) -> int:
    proc = await asyncio.create_subprocess_exec(*_healthcheck(), env={"UIBUS_PORT": str(port)},
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    return await asyncio.wait_for(proc.wait(), 20)


async def test_dockerfile_healthcheck_asks_the_port_in_uibus_port(app: App) -> None:
    """The image's health check, run as Docker would (with UIBUS_PORT from ENV or `docker run -e`):
    healthy on the port uibus serves, unhealthy where nothing answers. No port is hard-coded."""
    assert "26040" not in " ".join(_healthcheck())
    assert await _run_check(app.port) == 0
    assert await _run_check(free_port()) != 0


def _kustomize() -> list[dict[str, Any]]:
    kubectl = require_binary("kubectl")
    out = subprocess.run([kubectl, "kustomize", str(BASE)], capture_output=True, text=True, timeout=60, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_kustomize_renders_a_pdb_and_hpa_for_the_deployment() -> None:
    docs = _kustomize()
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    (dep,) = [d for d in by_kind["Deployment"] if d["metadata"]["name"] == "uibus"]
    labels = dep["spec"]["template"]["metadata"]["labels"]

    (pdb,) = by_kind["PodDisruptionBudget"]
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"].get("maxUnavailable") == 1 or pdb["spec"].get("minAvailable") == 1
    others = [d for d in by_kind["Deployment"] if d is not dep]  # the PDB must not also hold Redis
    assert all(not pdb["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"]
               .items() for d in others)

    (hpa,) = by_kind["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "uibus"}
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (cpu,) = [m for m in hpa["spec"]["metrics"] if m["type"] == "Resource" and m["resource"]["name"] == "cpu"]
    assert 0 < cpu["resource"]["target"]["averageUtilization"] <= 100
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["cpu"]  # utilization is a share of the request


def test_ingress_example_routes_grpc_and_http_to_the_service() -> None:
    docs = _docs(K8S / "examples" / "ingress.yaml")
    assert docs and {d["kind"] for d in docs} == {"Ingress"}
    svc = _one("Service", "uibus")
    ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    seen = {}
    for ing in docs:
        assert ing["apiVersion"] == "networking.k8s.io/v1"
        notes = ing["metadata"]["annotations"]
        protocol = notes["nginx.ingress.kubernetes.io/backend-protocol"]
        assert int(notes["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 3600  # long-lived streams
        assert int(notes["nginx.ingress.kubernetes.io/proxy-send-timeout"]) >= 3600
        assert ing["spec"]["tls"][0]["secretName"]
        hosts = {h for t in ing["spec"]["tls"] for h in t["hosts"]}
        for rule in ing["spec"]["rules"]:
            assert rule["host"] in hosts  # gRPC through ingress-nginx needs TLS (HTTP/2) at the controller
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                assert backend["name"] == "uibus" and backend["port"]["name"] in ports
                seen[protocol] = backend["port"]["name"]
        if protocol == "HTTP":
            assert notes["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"  # gRPC-Web streams
    assert seen == {"GRPC": "grpc", "HTTP": "http"}
    assert ports["grpc"] == 26040 and ports["http"] == 8080


def _compose_expand(text: str, password: str) -> str:
    """`text` as compose substitutes it with REDIS_PASSWORD set to `password`."""
    return re.sub(r"\$\{REDIS_PASSWORD(:\?[^}]*)?\}", password, text)


def test_redis_needs_a_password_in_compose_and_kubernetes() -> None:
    """Redis serves only with a password (a password-less Redis on the host's loopback was
    every agent's), and uibus's URL carries that same password: compose from REDIS_PASSWORD (which
    it requires), Kubernetes from the Secret `uibus-redis` (which the docs say how to make)."""
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    redis = services["redis"]
    command = redis["command"]
    assert command[command.index("--requirepass") + 1].startswith("${REDIS_PASSWORD:?")
    assert redis["environment"]["REDISCLI_AUTH"].startswith("${REDIS_PASSWORD:?")  # the healthcheck's redis-cli
    assert "redis-cli" in redis["healthcheck"]["test"]
    for name in ("uibus-1", "uibus-2"):
        url = services[name]["environment"]["UIBUS_REDIS_URL"]
        assert _compose_expand(url, "pw") == "redis://:pw@redis:6379/0", url
        assert url.startswith("redis://:${REDIS_PASSWORD:?"), url

    (server,) = _one("Deployment", "uibus-redis")["spec"]["template"]["spec"]["containers"]
    secret = {"name": "uibus-redis", "key": "password"}
    assert server["args"][server["args"].index("--requirepass") + 1] == "$(REDISCLI_AUTH)"
    assert {e["name"]: e for e in server["env"]}["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == secret
    (container,) = _one("Deployment", "uibus")["spec"]["template"]["spec"]["containers"]
    names = [e["name"] for e in container["env"]]
    env = {e["name"]: e for e in container["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == secret
    # the kubelet expands $(VAR) only from entries listed before it
    assert names.index("REDIS_PASSWORD") < names.index("UIBUS_REDIS_URL")
    assert env["UIBUS_REDIS_URL"]["value"] == "redis://:$(REDIS_PASSWORD)@uibus-redis:6379/0"
    assert "UIBUS_REDIS_URL" not in _one("ConfigMap", "uibus")["data"]  # env would win over it anyway
    create = 'kubectl create secret generic uibus-redis --from-literal=password="$(openssl rand -hex 32)"'
    assert create in (BASE / "uibus.yaml").read_text() and create in (REPO / "docs" / "deployment.md").read_text()


def test_redis_runs_locked_down() -> None:
    dep = _one("Deployment", "uibus-redis")
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ctx = {**pod.get("securityContext", {}), **container["securityContext"]}
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == 999
    assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"]["drop"] == ["ALL"] and "add" not in ctx["capabilities"]
    assert ctx["seccompProfile"]["type"] == "RuntimeDefault"
    # with a read-only root, Redis's only writes (AOF, RDB: its working directory /data) need a volume
    assert any(m["mountPath"] == "/data" for m in container["volumeMounts"])


def test_tokens_file_example_names_a_real_setting() -> None:
    text = (BASE / "uibus.yaml").read_text()
    assert "UIBUS_TOKENS_FILE" in text and "UIBUS_AUTH_TOKEN" in text
    _check_env_names({"UIBUS_TOKENS_FILE": "", "UIBUS_AUTH_TOKEN": ""})


def test_dockerfile_runs_uibus_as_non_root_on_all_interfaces() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^EXPOSE 26040 8080$", text, re.MULTILINE)
    assert re.search(r'^CMD \["uibus", "serve"\]$', text, re.MULTILINE)
    users = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
    assert users and not users[-1].startswith(("root", "0"))
    assert "UIBUS_HOST=0.0.0.0" in text
    for src in re.findall(r"^COPY (?!--from)(\S+)", text, re.MULTILINE):
        assert (REPO / src).exists() or "*" in src, f"Dockerfile copies missing {src}"


# The overlays that put uibus on an external Redis instead of the base's single-node uibus-redis, and
# the settings each must give the pods (through the ConfigMap the Deployment's envFrom names).
REDIS_OVERLAYS = {
    "redis-cluster": {"UIBUS_REDIS_URL": "redis://redis-cluster:6379/0", "UIBUS_REDIS_CLUSTER": "1",
                      "UIBUS_BUS_SHARDS": "256"},
    "redis-sentinel": {"UIBUS_REDIS_URL": "redis+sentinel://sentinel-0:26379,sentinel-1:26379,sentinel-2:26379"
                                          "/mymaster/0", "UIBUS_BUS_SHARDS": "256"},
}


def _kustomize_overlay(name: str) -> list[dict[str, Any]]:
    """The overlay as its header says to apply it: plain `kubectl kustomize` (what `kubectl apply
    -k` renders), with kustomize's default load restrictor: every file an overlay names is in its
    own folder or is a base (deploy/k8s/base) beside it."""
    kubectl = require_binary("kubectl")
    out = subprocess.run([kubectl, "kustomize", str(OVERLAYS / name)], capture_output=True, text=True, timeout=60,
                         check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _pod_env(docs: list[dict[str, Any]], deployment: str = "uibus") -> dict[str, Any]:
    """The environment of the Deployment's container as the kubelet builds it: every envFrom
    ConfigMap's data, then `env` over it (a secretKeyRef stays a dict)."""
    (dep,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == deployment]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    env: dict[str, Any] = {}
    for ref in container.get("envFrom", []):
        env.update(maps[ref["configMapRef"]["name"]])
    for e in container.get("env", []):
        env[e["name"]] = e.get("value", e.get("valueFrom"))
    return env


@pytest.mark.parametrize("overlay", sorted(REDIS_OVERLAYS))
def test_redis_overlay_points_uibus_at_its_redis_and_drops_the_single_node(
        overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = _kustomize_overlay(overlay)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    # uibus with its Service, HPA and PDB as in the base, but no Redis of its own: the external one replaces it
    assert names == {("ConfigMap", "uibus"), ("Deployment", "uibus"), ("Service", "uibus"),
                     ("HorizontalPodAutoscaler", "uibus"), ("PodDisruptionBudget", "uibus")}
    env = _pod_env(docs)
    _check_env_names(env)
    want = REDIS_OVERLAYS[overlay]
    assert {k: env.get(k) for k in want} == want
    assert "UIBUS_REDIS_CLUSTER" in want or "UIBUS_REDIS_CLUSTER" not in env  # sentinels are no cluster
    assert env["UIBUS_AUTH_TOKEN"]["secretKeyRef"]["name"] == "uibus"  # the base's token still applies
    cfg = _config_from_env({**{k: v for k, v in env.items() if isinstance(v, str)},
                            "UIBUS_AUTH_TOKEN": "from-the-secret"}, monkeypatch)
    assert cfg.redis_url == want["UIBUS_REDIS_URL"]
    assert cfg.redis_cluster is (overlay == "redis-cluster")
    assert cfg.bus_shards == 256
    import kubernetes_validate

    for doc in docs:
        for version in ("1.27.0", "1.37.0"):
            kubernetes_validate.validate(doc, version, strict=True)


def test_every_overlay_is_tested_and_says_how_to_apply_it() -> None:
    """Every overlay beside the base is one this module renders and validates (a new one fails
    here until it is added to REDIS_OVERLAYS), takes the base as a whole (so a manifest added
    there reaches it) and tells the operator the plain `kubectl apply -k` command."""
    found = {p.parent.name for p in OVERLAYS.glob("*/kustomization.yaml")}
    assert found == set(REDIS_OVERLAYS)
    # no kustomization above them; agent-sandbox stands apart (test_agent_sandbox_*)
    assert {p.name for p in K8S.iterdir()} == {"base", "overlays", "examples", "agent-sandbox"}
    for name in found:
        kustomization = OVERLAYS / name / "kustomization.yaml"
        assert yaml.safe_load(kustomization.read_text())["resources"] == ["../../base"], name
        assert f"kubectl apply -k deploy/k8s/overlays/{name}\n" in kustomization.read_text(), name


def test_no_doc_needs_the_load_restrictor_flag() -> None:
    """The layout lets kustomize take every overlay as it is; no doc may still tell users to
    switch its file-loading restriction off."""
    docs = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), REPO / "Dockerfile",
            REPO / "docker-compose.yml", *sorted(REPO.glob("*/README.md")),
            *sorted(p for p in (REPO / "deploy").rglob("*") if p.is_file())]
    said = [str(p.relative_to(REPO)) for p in docs if re.search(r"load.restrictor|LoadRestrictions", p.read_text())]
    assert not said, f"these still mention kustomize's load restrictor: {said}"


# deploy/k8s/agent-sandbox: uibus's hosted agents as kubernetes-sigs/agent-sandbox objects
# (docs/hosting/isolation.md, "Beyond one machine: Kubernetes"), for a KubernetesLauncher not built yet.
AGENT_SANDBOX = K8S / "agent-sandbox"
SANDBOX_API = "agents.x-k8s.io/v1alpha1"  # Sandbox; the extensions' kinds below:
SANDBOX_EXT_API = "extensions.agents.x-k8s.io/v1alpha1"
AGENT_SANDBOX_KINDS = {  # what `kubectl kustomize deploy/k8s/agent-sandbox` renders, by (kind, name)
    ("RuntimeClass", "gvisor"): "node.k8s.io/v1",
    ("ServiceAccount", "uibus"): "v1",
    ("Role", "uibus-agent-sandboxes"): "rbac.authorization.k8s.io/v1",
    ("RoleBinding", "uibus-agent-sandboxes"): "rbac.authorization.k8s.io/v1",
    ("NetworkPolicy", "uibus-agents"): "networking.k8s.io/v1",
    ("SandboxTemplate", "pi-acme"): SANDBOX_EXT_API,
    ("PersistentVolumeClaim", "agent-home-acme"): "v1",
    ("SandboxWarmPool", "pi-acme"): SANDBOX_EXT_API,
}
UIBUS_LABELS = ("sandbox.users.io/uibus-session", "sandbox.users.io/uibus-agent", "sandbox.users.io/uibus-tenant")


def _agent_sandbox() -> dict[tuple[str, str], dict[str, Any]]:
    kubectl = require_binary("kubectl")
    out = subprocess.run([kubectl, "kustomize", str(AGENT_SANDBOX)], capture_output=True, text=True, timeout=60,
                         check=True)
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    found = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(found) == len(docs), "a kind and name twice"
    return found


def test_agent_sandbox_renders_the_expected_objects_apart_from_the_base() -> None:
    docs = _agent_sandbox()
    assert {key: d["apiVersion"] for key, d in docs.items()} == AGENT_SANDBOX_KINDS
    # Every file is listed but the example claim (uibus makes the claims), and the claim is what it says.
    listed = yaml.safe_load((AGENT_SANDBOX / "kustomization.yaml").read_text())["resources"]
    assert set(listed) == {p.name for p in AGENT_SANDBOX.glob("*.yaml")} - {"kustomization.yaml",
                                                                             "sandboxclaim-example.yaml"}
    (claim,) = _docs(AGENT_SANDBOX / "sandboxclaim-example.yaml")
    assert (claim["kind"], claim["apiVersion"]) == ("SandboxClaim", SANDBOX_EXT_API)
    # No kustomization of the base or an overlay takes it in: what they render is unchanged.
    for path in (BASE / "kustomization.yaml", *OVERLAYS.glob("*/kustomization.yaml")):
        assert "agent-sandbox" not in path.read_text(), path
    assert not {d["kind"] for d in _kustomize()} & {"RuntimeClass", "SandboxTemplate", "NetworkPolicy", "Role"}
    assert (AGENT_SANDBOX / "README.md").is_file()
    assert "deploy/k8s/agent-sandbox/" in (REPO / "docs" / "hosting" / "isolation.md").read_text()


def test_agent_sandbox_template_locks_the_agent_down_with_uibus_limits() -> None:
    from uibus.agents.limits import DEFAULTS

    docs = _agent_sandbox()
    assert docs[("RuntimeClass", "gvisor")]["handler"] == "runsc"
    template = docs[("SandboxTemplate", "pi-acme")]["spec"]
    # its own NetworkPolicy (networkpolicy-agents.yaml) alone, not the controller's besides: policies add up
    assert template["networkPolicyManagement"] == "Unmanaged"
    pod = template["podTemplate"]["spec"]
    assert pod["runtimeClassName"] == "gvisor"
    assert pod["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in pod  # never uibus's account (rbac.yaml)
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/example/pi-agent:0.73"
    ctx = {**pod["securityContext"], **container["securityContext"]}
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] != 0 and ctx["runAsGroup"] != 0
    assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not ctx.get("privileged")
    # uibus's default agent limits (option `limits`), as the kubelet enforces them
    assert container["resources"]["limits"] == {"cpu": f"{DEFAULTS.cpu:g}", "memory": f"{DEFAULTS.memory_mb // 1024}Gi",
                                                "ephemeral-storage": f"{DEFAULTS.disk_mb // 1024}Gi"}
    # HOME is the tenant's PVC (rendered beside it); the workspace, the working directory, is a volume of
    # each Sandbox's own; /tmp is writable though the root filesystem is not.
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    home = volumes[mounts[env["HOME"]]]["persistentVolumeClaim"]["claimName"]
    assert docs[("PersistentVolumeClaim", home)]["metadata"]["labels"]["sandbox.users.io/uibus-tenant"] == "acme"
    workspace = mounts[container["workingDir"]]
    assert workspace in {t["metadata"]["name"] for t in template.get("volumeClaimTemplates", [])} or \
        "emptyDir" in volumes.get(workspace, {})
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert container["stdin"] is True and not container.get("tty")  # uibus speaks JSON lines on its stdio


def test_agent_sandbox_pool_claim_network_and_rbac_fit_together() -> None:
    docs = _agent_sandbox()
    template = docs[("SandboxTemplate", "pi-acme")]
    pod_labels = template["spec"]["podTemplate"]["metadata"]["labels"]
    pool = docs[("SandboxWarmPool", "pi-acme")]["spec"]
    assert pool["sandboxTemplateRef"] == {"name": "pi-acme"} and 1 <= pool["replicas"] <= 5

    (claim,) = _docs(AGENT_SANDBOX / "sandboxclaim-example.yaml")
    assert claim["spec"]["sandboxTemplateRef"] == {"name": "pi-acme"}
    assert claim["spec"]["warmpool"] == "pi-acme"
    labels, pod_extra = claim["metadata"]["labels"], claim["spec"]["additionalPodMetadata"]["labels"]
    for key in UIBUS_LABELS:  # the controller takes pod labels of its allowed domains only (sandbox.users.io)
        assert labels[key] and pod_extra[key] == labels[key], key
    assert labels["sandbox.users.io/uibus-tenant"] == pod_labels["sandbox.users.io/uibus-tenant"]
    assert claim["spec"]["lifecycle"]["shutdownPolicy"] == "Delete"  # a backstop if uibus dies

    policy = docs[("NetworkPolicy", "uibus-agents")]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"]
    uibus_pods = _one("Deployment", "uibus")["spec"]["template"]["metadata"]["labels"]
    (ingress,) = policy["ingress"]
    (source,) = ingress["from"]
    assert set(source) == {"podSelector"} and source["podSelector"]["matchLabels"].items() <= uibus_pods.items()
    assert not source["podSelector"]["matchLabels"].items() <= pod_labels.items()  # not agent to agent
    ports: set[int] = set()
    for rule in policy["egress"]:
        ports |= {p["port"] for p in rule["ports"]}
        for peer in rule["to"]:
            if "ipBlock" in peer and peer["ipBlock"]["cidr"] == "0.0.0.0/0":
                assert {p["port"] for p in rule["ports"]} == {443}
                assert {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16"} <= set(
                    peer["ipBlock"]["except"])
            elif "ipBlock" not in peer:  # DNS, and uibus's /mcp: pods, never "anything in the cluster"
                assert peer["podSelector"]["matchLabels"], peer
    assert ports == {53, 443, 8080}
    assert "egress proxy" in (AGENT_SANDBOX / "networkpolicy-agents.yaml").read_text()

    rules = {(g, r): set(rule["verbs"]) for rule in docs[("Role", "uibus-agent-sandboxes")]["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}
    manage = {"get", "list", "watch", "create", "delete"}
    assert rules == {("extensions.agents.x-k8s.io", "sandboxclaims"): manage, ("agents.x-k8s.io", "sandboxes"): manage,
                     ("extensions.agents.x-k8s.io", "sandboxtemplates"): {"get", "list", "watch"}}
    binding = docs[("RoleBinding", "uibus-agent-sandboxes")]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "uibus-agent-sandboxes"}
    (subject,) = binding["subjects"]
    assert subject["kind"] == "ServiceAccount" and subject["name"] != "default"  # every pod's, agents' too
    assert ("ServiceAccount", subject["name"]) in docs


@pytest.mark.parametrize("version", ["1.27.0", "1.37.0"])
def test_agent_sandbox_core_objects_validate_against_kubernetes_schemas(version: str) -> None:
    """The core-API objects, strictly, as test_k8s_manifests_validate_against_kubernetes_schemas does.
    The agent-sandbox objects (SandboxTemplate, SandboxWarmPool, SandboxClaim) cannot be: their
    schemas are the project's CRDs, which kubernetes-validate does not have offline; the tests
    above check their fields (names taken from its v1alpha1 Go types and CRDs)."""
    import kubernetes_validate

    docs = _agent_sandbox()
    core = [d for d in docs.values() if d["apiVersion"] not in (SANDBOX_API, SANDBOX_EXT_API)]
    assert {d["kind"] for d in core} == {"RuntimeClass", "NetworkPolicy", "Role", "RoleBinding", "ServiceAccount",
                                         "PersistentVolumeClaim"}
    for doc in core:
        kubernetes_validate.validate(doc, version, strict=True)
