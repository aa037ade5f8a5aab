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
from uibus.config import Config

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAYS = K8S / "overlays"
# The release the image, compose and the k8s base are tagged with by default: pyproject's fallback version
# (the version is otherwise derived from git tags; tests/test_release.py).
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools_scm"]["fallback_version"]
IMAGE = f"uibus:{VERSION}"


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
    assert container["image"] == IMAGE
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

    redis_host = re.match(r"redis://([^:/]+)", cfg.redis_url)
    assert redis_host, cfg.redis_url
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
        cfg = _config_from_env({**env, "UIBUS_AUTH_TOKEN": "set-by-the-operator"}, monkeypatch)
        assert cfg.host == "0.0.0.0", name
        assert cfg.redis_url.startswith("redis://redis:"), name
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
    assert builder["build"]["args"]["VERSION"] == VERSION
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
    assert {p.name for p in K8S.iterdir()} == {"base", "overlays", "examples"}  # no kustomization above them
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
