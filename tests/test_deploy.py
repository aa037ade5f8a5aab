"""Structural checks of the deployment files (no Docker engine or cluster here): the probes are
native gRPC on the port uibus serves, the server binds every interface, every UIBUS_* setting is
a real config field with a value `uibus serve` accepts, and the compose front reaches both replicas."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from uibus.config import Config

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "k8s"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _k8s() -> list[dict[str, Any]]:
    return [d for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml" for d in _docs(p)]


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
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"}


def test_k8s_deployment_probes_are_grpc_on_26040(monkeypatch: pytest.MonkeyPatch) -> None:
    dep = _one("Deployment", "uibus")
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == 26040, probe
        assert container[probe]["grpc"].get("service", "") == ""  # uibus reports "" NOT_SERVING on shutdown
        assert "httpGet" not in container[probe] and "exec" not in container[probe]
    assert {p["containerPort"] for p in container["ports"]} == {26040, 8080}
    assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()

    (ref,) = container["envFrom"]
    cm = _one("ConfigMap", ref["configMapRef"]["name"])
    _check_env_names(cm["data"])
    cfg = _config_from_env(cm["data"], monkeypatch)
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
    replicas = {name: s for name, s in services.items() if s.get("build") == "."}
    assert len(replicas) == 2
    for name, svc in replicas.items():
        env = svc["environment"]
        _check_env_names(env)
        cfg = _config_from_env(env, monkeypatch)
        assert cfg.host == "0.0.0.0", name
        assert cfg.redis_url.startswith("redis://redis:"), name
        assert "redis" in svc["depends_on"]
    front = services["front"]
    conf_path = front["volumes"][0].split(":")[0]
    conf = (REPO / conf_path).read_text()
    for name in replicas:
        assert f"server {name}:26040;" in conf and f"server {name}:8080;" in conf
    assert "grpc_pass grpc://" in conf and "listen 26040 http2;" in conf
    assert "proxy_buffering off;" in conf  # gRPC-Web server streams must not be buffered


def test_dockerfile_runs_uibus_as_non_root_on_all_interfaces() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in text
    assert re.search(r"^EXPOSE 26040 8080$", text, re.MULTILINE)
    assert re.search(r'^CMD \["uibus", "serve"\]$', text, re.MULTILINE)
    users = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
    assert users and not users[-1].startswith(("root", "0"))
    assert "UIBUS_HOST=0.0.0.0" in text
    for src in re.findall(r"^COPY (?!--from)(\S+)", text, re.MULTILINE):
        assert (REPO / src).exists() or "*" in src, f"Dockerfile copies missing {src}"
