"""The chart's prefill/decode disaggregation (pd.enabled), as an operator meets it:
a prefill and a decode Deployment, and sglang-router in PD mode in front of them.

Rendered by Helm's own engine and checked against the Kubernetes schemas; each role's
command line is parsed by `sluice serve`'s own parser, and the router's by
sglang-router's. What PD needs from the rendered objects: the router finds each
role's pods by label, reads a prefill pod's bootstrap port from the annotation it
looks for, and addresses every prefill pod at its own IP (the decode server connects
to the bootstrap host the router names), so no Service may stand between them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from typing import NamedTuple, get_args, get_type_hints

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from sglang_router import router_args
from sglang_router.launch_router import parse_router_args
from sglang_router.router import Router

from config.cli import build_serve_parser, settings_from_args
from config.settings import EngineSettings
from tests.test_docker import _dockerfile_stages, _exec_form
from tests.test_helm_chart import (  # noqa: F401 - `chart` is a fixture
    API_KEY_VAR,
    CHART,
    CRD_SCHEMAS,
    KUBE_VERSIONS,
    _values_file,
    chart,
)

ROLES = ("prefill", "decode")
ROUTER_COMMAND = ["python3", "-m", "sglang_router.launch_router"]


def _with_pd(*files: str, **extra: object) -> dict:
    values: dict = {}
    for name in (*files, "values-pd.yaml"):
        values = {**values, **_values_file(name)}
    return {**values, **extra}


SCENARIOS = {
    "cpu-pd": lambda: _with_pd("values-cpu.yaml"),
    # GPU roles, NCCL transfer, per-role resources and args, an API key from an existing
    # Secret, an Ingress, a ServiceMonitor and per-side router policies.
    "gpu-pd-all-features": lambda: _with_pd(
        "values-gpu-llama3-8b.yaml",
        pd={"enabled": True, "bootstrapPort": 9100, "transferBackend": "nccl", "timeout": 120,
            "prefill": {"replicaCount": 3, "extraArgs": ["--chunked-prefill-size", "8192"],
                        "resources": {"requests": {"cpu": "8", "memory": "64Gi"}}},
            "decode": {"replicaCount": 1}},
        apiKey={"existingSecret": "llm-keys", "secretKey": "sluice"},
        ingress={"enabled": True, "className": "nginx"},
        metrics={"serviceMonitor": {"enabled": True}},
        router={**_values_file("values-pd.yaml")["router"], "prefillPolicy": "bucket", "decodePolicy": "power_of_two"},
    ),
    # A 60-character name: every role's names must stay distinct within 63 characters.
    "long-name-pd": lambda: _with_pd("values-cpu.yaml", nameOverride="n" * 60, apiKey={"value": "sk-test"}),
}


class Release(NamedTuple):
    name: str
    values: dict
    merged: dict
    objects: list[dict]
    notes: str


def _render(chart, values: dict) -> tuple[list[dict], str]:  # noqa: F811
    rendered = chart.render(values, name="demo", namespace="llm", is_install=True)
    notes = rendered.pop("sluice/templates/NOTES.txt")
    return [doc for text in rendered.values() for doc in yaml.safe_load_all(text) if doc], notes


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def release(request, chart) -> Release:  # noqa: F811
    values = SCENARIOS[request.param]()
    objects, notes = _render(chart, values)
    return Release(request.param, values, chart.merge_values(values), objects, notes)


def _by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def _component(obj: dict) -> str | None:
    return obj["metadata"]["labels"].get("app.kubernetes.io/component")


def _role(objects: list[dict], kind: str, role: str) -> dict:
    (obj,) = [o for o in _by_kind(objects, kind) if _component(o) == role]
    return obj


def _pod(objects: list[dict], role: str) -> dict:
    return _role(objects, "Deployment", role)["spec"]["template"]


def _router_args(objects: list[dict]) -> router_args.RouterArgs:
    (container,) = _pod(objects, "router")["spec"]["containers"]
    assert container["command"] == ROUTER_COMMAND
    args = [a.replace(API_KEY_VAR, "dummy-key") for a in container["args"]]
    try:
        return parse_router_args(args)
    except SystemExit:
        pytest.fail(f"sglang-router rejects the router pod's args: {args}")


def _matches(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


# ------------------------------------------------------------------ the chart


def test_values_validate_against_schema(release, chart):  # noqa: F811
    chart.validate_schema(release.merged)
    jsonschema.Draft7Validator(json.loads((CHART / "values.schema.json").read_text())).validate(release.merged)


def test_helm_lint_strict_is_clean(release):
    report = helm.lint(CHART, release.values, strict=True, namespace="llm")
    assert report["errors"] == [], report["messages"]
    assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(release, kube_version):
    for obj in release.objects:
        crd = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        if crd:
            jsonschema.validate(obj, crd)
        else:
            kubernetes_validate.validate(obj, kube_version, strict=True)


def test_a_prefill_and_a_decode_deployment_replace_the_single_server(release):
    merged, objects = release.merged, release.objects
    deployments = {_component(d): d for d in _by_kind(objects, "Deployment")}
    assert set(deployments) == {"prefill", "decode", "router"}
    for role in ROLES:
        deploy = deployments[role]
        assert deploy["metadata"]["name"].endswith(f"-{role}")
        assert deploy["spec"]["replicas"] == merged["pd"][role]["replicaCount"]
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), names
    for kind, name in names:
        if kind in ("Deployment", "Service"):  # DNS labels: a Service name, a pod's name prefix
            assert len(name) <= 63, name


def test_no_template_leaks_nil_or_none(release):
    text = yaml.safe_dump_all(release.objects).replace("clusterIP: None", "") + release.notes
    assert "<nil>" not in text and "None" not in text and "%!" not in text


# ------------------------------------------------ role args -> sluice serve


@pytest.mark.parametrize("role", ROLES)
def test_each_role_runs_sluice_serve_in_its_disaggregation_mode(release, role):
    """ENTRYPOINT + the role's args parse and validate as `sluice serve`; the role, the
    bootstrap port and the PD knobs reach the server, and so does every serve.* value."""
    merged, objects = release.merged, release.objects
    (container,) = _pod(objects, role)["spec"]["containers"]
    target = "cpu" if container["image"].endswith("-cpu") else "cuda"
    env_names = {e["name"] for e in container["env"]}
    for ref in re.findall(r"\$\((\w+)\)", " ".join(container["args"])):
        assert ref in env_names, f"$({ref}) would not be expanded by Kubernetes"
    argv = _exec_form(_dockerfile_stages()[target], "ENTRYPOINT")[2:]
    argv += [a.replace(API_KEY_VAR, "dummy-key") for a in container["args"]]
    try:
        engine, server = settings_from_args(build_serve_parser().parse_args(argv))
    except SystemExit:
        pytest.fail(f"`sluice serve` rejects the {role} pod's args: {argv}")
    pd = merged["pd"]
    assert engine.disaggregation_mode == role
    assert engine.disaggregation_bootstrap_port == pd["bootstrapPort"]
    defaults = EngineSettings()
    # Helm drops null values from the merged values: a missing key is the server default.
    assert engine.disaggregation_transfer_backend == pd.get("transferBackend", defaults.disaggregation_transfer_backend)
    assert engine.disaggregation_timeout == pd.get("timeout", defaults.disaggregation_timeout)
    assert server.host == "0.0.0.0" and server.port == merged["containerPort"]
    role_args = pd[role]["extraArgs"]
    for key, value in merged["serve"].items():
        field = re.sub(r"[A-Z]", lambda m: "_" + m.group().lower(), key)
        if "--" + field.replace("_", "-") in role_args:
            continue  # pd.<role>.extraArgs come last and win
        got = getattr(engine if hasattr(engine, field) else server, field)
        assert got == value, f"serve.{key}={value!r} reached the {role} server as {got!r}"
    if "--chunked-prefill-size" in role_args:
        assert engine.chunked_prefill_size == 8192


def test_pd_knobs_follow_the_settings_schema():
    """pd.* mirrors the server's disaggregation knobs: its default port, its backends."""
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["pd"]["properties"]
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["pd"]
    assert defaults["bootstrapPort"] == EngineSettings().disaggregation_bootstrap_port
    backends = get_args(get_type_hints(EngineSettings)["disaggregation_transfer_backend"])
    assert set(schema["transferBackend"]["enum"]) - {None} == set(backends)


# ------------------------------------------------ the bootstrap port


def test_prefill_pods_expose_and_announce_the_bootstrap_port(release):
    """Decode servers connect to a prefill pod's bootstrap port; the router learns the
    port from the pod annotation it reads (sglang-router 0.3: fixed, not a flag)."""
    merged, objects = release.merged, release.objects
    port = merged["pd"]["bootstrapPort"]
    annotation = _router_args(objects).bootstrap_port_annotation
    prefill, decode = _pod(objects, "prefill"), _pod(objects, "decode")
    assert prefill["metadata"]["annotations"][annotation] == str(port)
    assert 0 < int(prefill["metadata"]["annotations"][annotation]) < 65536  # the router parses it as u16
    (container,) = prefill["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": merged["containerPort"], "bootstrap": port}
    (container,) = decode["spec"]["containers"]
    assert [p["name"] for p in container["ports"]] == ["http"]
    assert annotation not in decode["metadata"].get("annotations", {})
    service = _role(objects, "Service", "prefill")
    (bootstrap,) = [p for p in service["spec"]["ports"] if p["name"] == "bootstrap"]
    assert bootstrap["port"] == port and bootstrap["targetPort"] == "bootstrap"


def test_nothing_balances_requests_over_prefill_pods(release):
    """The router names one prefill pod's IP as each request's bootstrap host, so the
    pods must be reached one by one: the role Services are headless and no other
    Service selects a prefill or decode pod."""
    objects = release.objects
    for service in _by_kind(objects, "Service"):
        selector = service["spec"]["selector"]
        if _component(service) in ROLES:
            assert service["spec"]["clusterIP"] == "None"
            assert _matches(selector, _pod(objects, _component(service))["metadata"]["labels"])
        else:
            for role in ROLES:
                assert not _matches(selector, _pod(objects, role)["metadata"]["labels"]), service["metadata"]["name"]


# ------------------------------------------------ router args -> sglang-router


def test_router_runs_in_pd_mode_and_discovers_each_role_by_label(release):
    merged, objects = release.merged, release.objects
    parsed = _router_args(objects)
    Router.from_args(dataclasses.replace(parsed))  # the Rust-side config accepts them too
    assert parsed.pd_disaggregation and parsed.service_discovery
    assert parsed.prefill_urls == [] and parsed.decode_urls == [], "pods come from discovery, one by one"
    assert parsed.service_discovery_namespace == "llm"
    assert parsed.service_discovery_port == merged["containerPort"]
    pods = {role: _pod(objects, role)["metadata"]["labels"] for role in (*ROLES, "router")}
    assert _matches(parsed.prefill_selector, pods["prefill"])
    assert _matches(parsed.decode_selector, pods["decode"])
    assert not _matches(parsed.prefill_selector, pods["decode"]) and not _matches(parsed.decode_selector, pods["prefill"])
    assert not _matches(parsed.prefill_selector, pods["router"]) and not _matches(parsed.decode_selector, pods["router"])
    for role in ROLES:
        (container,) = _pod(objects, role)["spec"]["containers"]
        assert {"name": "http", "containerPort": parsed.service_discovery_port, "protocol": "TCP"} in container["ports"]
    router = merged["router"]
    assert parsed.policy == router["policy"]
    assert parsed.prefill_policy == router.get("prefillPolicy") and parsed.decode_policy == router.get("decodePolicy")
    assert (parsed.api_key == "dummy-key") == bool(merged["apiKey"]["existingSecret"] or merged["apiKey"]["value"])


def test_deployments_never_claim_each_others_pods(release):
    objects = release.objects
    for owner in (*ROLES, "router"):
        selector = _role(objects, "Deployment", owner)["spec"]["selector"]["matchLabels"]
        for other in (*ROLES, "router"):
            assert _matches(selector, _pod(objects, other)["metadata"]["labels"]) == (owner == other), (owner, other)


def test_router_may_list_and_watch_pods_in_its_namespace_only(release):
    objects = release.objects
    pod = _pod(objects, "router")["spec"]
    assert pod["automountServiceAccountToken"] is True
    (binding,) = _by_kind(objects, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": "llm"}]
    (role,) = _by_kind(objects, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert not _by_kind(objects, "ClusterRole")


def test_schema_policies_are_the_routers_own():
    parser = argparse.ArgumentParser()
    router_args.RouterArgs.add_cli_args(parser, use_router_prefix=False)
    choices = {a.dest: set(a.choices) for a in parser._actions if a.choices}
    props = json.loads((CHART / "values.schema.json").read_text())["properties"]["router"]["properties"]
    assert set(props["prefillPolicy"]["enum"]) - {None} == choices["prefill_policy"]
    assert set(props["decodePolicy"]["enum"]) - {None} == choices["decode_policy"]


# ------------------------------------------------ pods, budgets, clients


def test_roles_get_their_resources_gpus_and_image(release):
    merged, objects = release.merged, release.objects
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    for role in ROLES:
        (container,) = _pod(objects, role)["spec"]["containers"]
        res = container.get("resources", {})
        own = merged["pd"][role]["resources"] or merged["resources"]
        for kind, amounts in own.items():
            assert amounts.items() <= res[kind].items(), role
        gpus = merged["gpu"]["count"]
        if gpus:
            assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == gpus
            assert container["image"] == f"sluice:{app_version}"
        else:
            assert "nvidia.com/gpu" not in json.dumps(res)
            assert container["image"] == f"sluice:{app_version}-cpu"
        assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_each_role_has_its_own_disruption_budget(release):
    objects = release.objects
    budgets = _by_kind(objects, "PodDisruptionBudget")
    assert sorted(_component(b) for b in budgets) == sorted(ROLES)
    for budget in budgets:
        selector = budget["spec"]["selector"]["matchLabels"]
        for role in ROLES:
            assert _matches(selector, _pod(objects, role)["metadata"]["labels"]) == (_component(budget) == role)


def test_service_monitor_scrapes_both_roles(release):
    objects = release.objects
    for monitor in _by_kind(objects, "ServiceMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"]
        for role in ROLES:
            service = _role(objects, "Service", role)
            assert _matches(selector, service["metadata"]["labels"])
            assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_clients_are_sent_to_the_router(release):
    objects, notes = release.objects, release.notes
    router = _role(objects, "Deployment", "router")["metadata"]["name"]
    assert f"port-forward svc/{router} " in notes and "prefill/decode" in notes
    for role in ROLES:
        assert f"rollout status deploy/{_role(objects, 'Deployment', role)['metadata']['name']}" in notes
    for ingress in _by_kind(objects, "Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                assert path["backend"]["service"]["name"] == router


def test_pd_deploys_the_router_even_without_router_enabled(chart):  # noqa: F811
    objects, _ = _render(chart, {"pd": {"enabled": True}})
    assert {_component(d) for d in _by_kind(objects, "Deployment")} == {"prefill", "decode", "router"}
    assert _router_args(objects).pd_disaggregation


def test_pd_refuses_autoscaling_it_cannot_do(chart):  # noqa: F811
    with pytest.raises(Exception, match="pd.prefill.replicaCount"):
        _render(chart, {"pd": {"enabled": True}, "autoscaling": {"enabled": True}})


def test_schema_rejects_an_unknown_pd_key_or_backend(chart):  # noqa: F811
    with pytest.raises(helm.HelmValuesError, match="bootstrapPorts"):
        chart.validate_schema({"pd": {"bootstrapPorts": 8998}})
    with pytest.raises(helm.HelmValuesError, match="transferBackend"):
        chart.validate_schema({"pd": {"transferBackend": "rdma"}})


def test_values_pd_file_says_what_it_promises():
    values = yaml.safe_load((CHART / "values-pd.yaml").read_text())
    assert values["pd"]["enabled"] is True and values["router"]["enabled"] is True
    assert values["pd"]["prefill"]["replicaCount"] >= 2, "the file should show several prefill pods working"
    assert values["pd"]["bootstrapPort"] == EngineSettings().disaggregation_bootstrap_port


def test_default_install_is_unchanged_by_pd(chart):  # noqa: F811
    objects, notes = _render(chart, {})
    (deploy,) = _by_kind(objects, "Deployment")
    assert _component(deploy) is None and "--disaggregation-mode" not in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "sglang.ai/bootstrap-port" not in json.dumps(objects)
    assert "prefill" not in notes

