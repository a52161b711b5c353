"""The chart's data-parallel mode: sglang-router as its own Deployment in front of the
sluice replicas (router.enabled), as an operator meets it.

Rendered by Helm's own engine, checked against the Kubernetes schemas, and the router
container's command line parsed by sglang-router's own parser; the helpers and the
scenarios' base values come from tests/test_helm_chart.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import tomllib
from typing import NamedTuple

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from sglang_router import router_args
from sglang_router.launch_router import parse_router_args
from sglang_router.router import Router

from tests.test_docker import _dockerfile_stages
from tests.test_helm_chart import (  # noqa: F401 - `chart` is a fixture
    API_KEY_VAR,
    CHART,
    CRD_SCHEMAS,
    KUBE_VERSIONS,
    ROOT,
    _values_file,
    chart,
)

ROUTER_COMMAND = ["python3", "-m", "sglang_router.launch_router"]


def _with_router(*files: str, **extra: object) -> dict:
    values: dict = {}
    for name in files:
        values = {**values, **_values_file(name)}
    return {**values, **_values_file("values-router.yaml"), **extra}


SCENARIOS = {
    "cpu-router": lambda: _with_router("values-cpu.yaml"),
    # GPU replicas, an API key from an existing Secret, an Ingress, KEDA, and router flags.
    "gpu-router-all-features": lambda: _with_router(
        "values-gpu-llama3-8b.yaml",
        apiKey={"existingSecret": "llm-keys", "secretKey": "sluice"},
        ingress={"enabled": True, "className": "nginx"},
        autoscaling={"enabled": True, "kind": "keda", "maxReplicas": 8},
        router={"enabled": True, "policy": "round_robin", "extraArgs": ["--cache-threshold", "0.5"],
                "image": {"repository": "registry.local/sluice", "tag": "0.1.0-cpu"},
                "nodeSelector": {"pool": "cpu"}, "service": {"type": "LoadBalancer", "port": 8080}},
    ),
    # A 60-character name: the router's names must stay distinct within 63 characters.
    "long-name-router": lambda: _with_router("values-cpu.yaml", nameOverride="n" * 60, apiKey={"value": "sk-test"}),
}


class Release(NamedTuple):
    name: str
    merged: dict
    objects: list[dict]
    notes: str


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def release(request, chart) -> Release:  # noqa: F811 - `chart` is the imported fixture
    values = SCENARIOS[request.param]()
    rendered = chart.render(values, name="demo", namespace="llm", is_install=True)
    notes = rendered.pop("sluice/templates/NOTES.txt")
    objects = [doc for text in rendered.values() for doc in yaml.safe_load_all(text) if doc]
    return Release(request.param, chart.merge_values(values), objects, notes)


def _by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def _router_deployment(objects: list[dict]) -> dict:
    (deploy,) = [d for d in _by_kind(objects, "Deployment")
                 if d["metadata"]["labels"].get("app.kubernetes.io/component") == "router"]
    return deploy


def _sluice_deployment(objects: list[dict]) -> dict:
    (deploy,) = [d for d in _by_kind(objects, "Deployment") if d is not _router_deployment(objects)]
    return deploy


def _router_container(objects: list[dict]) -> dict:
    (container,) = _router_deployment(objects)["spec"]["template"]["spec"]["containers"]
    return container


def _parse(container: dict) -> router_args.RouterArgs:
    args = [a.replace(API_KEY_VAR, "dummy-key") for a in container["args"]]
    try:
        return parse_router_args(args)
    except SystemExit:
        pytest.fail(f"sglang-router rejects the router pod's args: {args}")


def _matches(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


# ------------------------------------------------------------------ the chart


def test_router_is_off_by_default(chart):  # noqa: F811
    rendered = chart.render({}, name="demo", namespace="llm", is_install=True)
    notes = rendered.pop("sluice/templates/NOTES.txt")
    objects = [doc for text in rendered.values() for doc in yaml.safe_load_all(text) if doc]
    assert len(_by_kind(objects, "Deployment")) == 1
    assert not _by_kind(objects, "Role") and not _by_kind(objects, "RoleBinding")
    assert "router" not in notes


def test_values_validate_against_schema(release, chart):  # noqa: F811
    chart.validate_schema(release.merged)
    jsonschema.Draft7Validator(json.loads((CHART / "values.schema.json").read_text())).validate(release.merged)


def test_schema_rejects_an_unknown_policy_or_key(chart):  # noqa: F811
    with pytest.raises(helm.HelmValuesError, match="policy"):
        chart.validate_schema({"router": {"policy": "least_loaded"}})
    with pytest.raises(helm.HelmValuesError, match="workerUrls"):
        chart.validate_schema({"router": {"workerUrls": ["http://x"]}})


def test_helm_lint_strict_is_clean(release):
    report = helm.lint(CHART, SCENARIOS[release.name](), strict=True, namespace="llm")
    assert report["errors"] == [], report["messages"]
    assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(release, kube_version):
    kinds = {o["kind"] for o in release.objects}
    assert {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"} <= kinds
    for obj in release.objects:
        crd = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        if crd:
            jsonschema.validate(obj, crd)
        else:
            kubernetes_validate.validate(obj, kube_version, strict=True)


def test_object_names_are_unique_per_kind(release):
    names = [(o["kind"], o["metadata"]["name"]) for o in release.objects]
    assert len(names) == len(set(names)), names
    assert _router_deployment(release.objects)["metadata"]["name"].endswith("-router")


# ------------------------------------------------ router args -> sglang-router


def test_router_command_line_is_accepted_by_sglang_router(release):
    """The rendered args parse with the router's own parser and build a Router; service
    discovery watches this namespace for exactly the sluice pods' selector labels, on
    the port sluice serves."""
    merged, objects = release.merged, release.objects
    container = _router_container(objects)
    assert container["command"] == ROUTER_COMMAND
    env_names = {e["name"] for e in container.get("env", [])}
    for ref in re.findall(r"\$\((\w+)\)", " ".join(container["args"])):
        assert ref in env_names, f"$({ref}) would not be expanded by Kubernetes"
    parsed = _parse(container)
    # The Rust-side config accepts them too (it connects only on .start()); from_args
    # rewrites the args it is given, hence the copy.
    Router.from_args(dataclasses.replace(parsed))
    assert parsed.service_discovery and parsed.worker_urls == [] and not parsed.pd_disaggregation
    assert parsed.service_discovery_namespace == "llm"
    sluice = _sluice_deployment(objects)
    assert parsed.selector == sluice["spec"]["selector"]["matchLabels"]
    sluice_port = sluice["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert parsed.service_discovery_port == sluice_port == merged["containerPort"]
    assert parsed.policy == merged["router"]["policy"]
    assert parsed.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert parsed.port == ports["http"] == merged["router"]["containerPort"]
    assert parsed.prometheus_port == ports["metrics"] == merged["router"]["metricsPort"]
    assert (parsed.api_key == "dummy-key") == bool(merged["apiKey"]["existingSecret"] or merged["apiKey"]["value"])
    if "--cache-threshold" in merged["router"]["extraArgs"]:
        assert parsed.cache_threshold == 0.5


def test_schema_policies_are_the_routers_own():
    parser = argparse.ArgumentParser()
    router_args.RouterArgs.add_cli_args(parser, use_router_prefix=False)
    (policy,) = [a for a in parser._actions if "--policy" in a.option_strings]
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["properties"]["router"]["properties"]["policy"]["enum"]) == set(policy.choices)


def test_router_selects_the_sluice_pods_and_nothing_selects_the_router(release):
    objects = release.objects
    router_pod = _router_deployment(objects)["spec"]["template"]["metadata"]["labels"]
    sluice_pod = _sluice_deployment(objects)["spec"]["template"]["metadata"]["labels"]
    selector = _parse(_router_container(objects)).selector
    assert _matches(selector, sluice_pod) and not _matches(selector, router_pod), "the router would route to itself"
    for obj in objects:
        spec = obj.get("spec", {})
        sel = spec.get("selector")
        if obj["kind"] in ("Service", "PodDisruptionBudget", "Deployment") and sel:
            sel = sel.get("matchLabels", sel)
            if obj["metadata"]["name"].endswith("-router"):
                assert _matches(sel, router_pod) and not _matches(sel, sluice_pod), obj["metadata"]["name"]
            else:
                assert not _matches(sel, router_pod), f"{obj['kind']} {obj['metadata']['name']} selects the router"


def test_router_may_list_and_watch_pods_in_its_namespace_only(release):
    objects = release.objects
    pod = _router_deployment(objects)["spec"]["template"]["spec"]
    account = pod["serviceAccountName"]
    assert pod["automountServiceAccountToken"] is True, "service discovery needs the API token"
    assert account in {sa["metadata"]["name"] for sa in _by_kind(objects, "ServiceAccount")}
    assert not _by_kind(objects, "ClusterRole") and not _by_kind(objects, "ClusterRoleBinding")
    (binding,) = _by_kind(objects, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "llm"}]
    (role,) = [r for r in _by_kind(objects, "Role") if r["metadata"]["name"] == binding["roleRef"]["name"]]
    (rule,) = role["rules"]
    assert rule["apiGroups"] == [""] and rule["resources"] == ["pods"]
    assert set(rule["verbs"]) == {"get", "list", "watch"}


def test_router_service_probes_and_image(release):
    merged, objects = release.merged, release.objects
    container = _router_container(objects)
    assert container["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    assert "nvidia.com/gpu" not in str(container.get("resources", {}))
    (service,) = [s for s in _by_kind(objects, "Service") if s["metadata"]["name"].endswith("-router")]
    assert service["spec"]["type"] == merged["router"]["service"]["type"]
    http = {p["name"]: p for p in service["spec"]["ports"]}["http"]
    assert http["port"] == merged["router"]["service"]["port"] and http["targetPort"] == "http"
    image = merged["router"]["image"]
    if image["tag"]:
        assert container["image"] == f"{image['repository']}:{image['tag']}"
    else:
        app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
        assert container["image"] == f"sluice:{app_version}-cpu", "the router runs from the CPU image"


def test_clients_are_sent_to_the_router(release):
    objects, notes = release.objects, release.notes
    router_service = _router_deployment(objects)["metadata"]["name"]
    assert f"port-forward svc/{router_service} " in notes
    for ingress in _by_kind(objects, "Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                assert path["backend"]["service"]["name"] == router_service


def test_values_router_file_says_what_it_promises():
    values = yaml.safe_load((CHART / "values-router.yaml").read_text())
    assert values["router"]["enabled"] is True and values["router"]["policy"] == "cache_aware"
    assert values["replicaCount"] >= 2


# ------------------------------------------------------------------ the images


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_both_images_carry_the_router_the_test_extra_pins(target):
    stage = _dockerfile_stages()[target]
    args = dict(a.split("=", 1) for o, a in stage if o == "ARG" and "=" in a)
    version = args["SGLANG_ROUTER_VERSION"]
    assert any(o == "RUN" and '"sglang-router==${SGLANG_ROUTER_VERSION}"' in a for o, a in stage)
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    (spec,) = [d.removeprefix("sglang-router") for d in extra if d.startswith("sglang-router")]
    assert Version(version) in SpecifierSet(spec), "the image's router must be the one the tests run"
