"""The Helm chart, as an operator meets it.

The chart is rendered by Helm's own Go engine (helm-python-sdk binds the Helm v4 SDK),
every manifest is checked against the Kubernetes OpenAPI schemas (kubernetes-validate,
offline), and the command line each pod would run is fed to `sluice serve`'s real
parser and settings validation.
"""

from __future__ import annotations

import json
import re
import types
from pathlib import Path
from typing import Literal, NamedTuple, Union, get_args, get_origin

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from config.cli import build_serve_parser, settings_from_args
from config.settings import EngineSettings, ServerSettings, settings_fields
from tests.test_docker import _dockerfile_stages, _exec_form

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "sluice"
DOCKERFILE = ROOT / "Dockerfile"
KUBE_VERSIONS = ("1.25", kubernetes_validate.latest_version())  # Chart.yaml: kubeVersion >=1.25
API_KEY_VAR = "$(SLUICE_API_KEY)"


def _values_file(name: str) -> dict:
    # Helm's own YAML reader, so numbers reach the templates typed as `helm -f` types them.
    return helm.values_from_yaml((CHART / name).read_text())


# Each scenario is the user-supplied values of one `helm install`.
SCENARIOS = {
    "default": lambda: {},
    "cpu": lambda: _values_file("values-cpu.yaml"),
    "gpu-llama3-8b": lambda: _values_file("values-gpu-llama3-8b.yaml"),
    # Every optional object switched on, with an API key the chart creates.
    "llama3-all-features": lambda: {
        **_values_file("values-gpu-llama3-8b.yaml"),
        "apiKey": {"value": "sk-test"},
        "ingress": {"enabled": True, "className": "nginx",
                    "tls": [{"hosts": ["sluice.local"], "secretName": "sluice-tls"}]},
        "metrics": {"serviceMonitor": {"enabled": True}},
        "autoscaling": {"enabled": True, "kind": "hpa"},
        "extraArgs": ["--schedule-policy", "lpm", "--enable-mixed-chunk"],
        "serve": {**_values_file("values-gpu-llama3-8b.yaml")["serve"],
                  "disableRadixCache": False, "enableMetrics": True, "logLevel": "debug", "distTimeout": 120},
        "podAnnotations": {"team": "ml"},
    },
    # CPU with KEDA, an operator-managed Secret, an existing claim and the CPU knobs.
    "cpu-keda-existing-secret": lambda: {
        **_values_file("values-cpu.yaml"),
        "serve": {**_values_file("values-cpu.yaml")["serve"],
                  "kvCacheDtype": "bfloat16", "disableCpuKernels": True, "quantization": "int8"},
        "apiKey": {"existingSecret": "llm-keys", "secretKey": "sluice"},
        "autoscaling": {"enabled": True, "kind": "keda", "maxReplicas": 8},
        "modelStorage": {"persistence": {"enabled": True, "existingClaim": "shared-models",
                                         "accessModes": ["ReadOnlyMany"]}},
        "podDisruptionBudget": {"minAvailable": 1},
    },
}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c


class Release(NamedTuple):
    name: str  # scenario
    values: dict  # what the user passed
    merged: dict  # what the templates saw (chart defaults + values)
    objects: list[dict]  # rendered Kubernetes objects
    notes: str  # rendered NOTES.txt


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def release(request, chart) -> Release:
    values = SCENARIOS[request.param]()
    rendered = chart.render(values, name="demo", namespace="llm", is_install=True)
    notes = rendered.pop("sluice/templates/NOTES.txt")
    objects = [doc for text in rendered.values() for doc in yaml.safe_load_all(text) if doc]
    return Release(request.param, values, chart.merge_values(values), objects, notes)


def _one(objects: list[dict], kind: str) -> dict:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def _container(objects: list[dict]) -> dict:
    return _one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]


# ------------------------------------------------------------------ Helm chart


def test_values_schema_is_valid_draft7():
    jsonschema.Draft7Validator.check_schema(json.loads((CHART / "values.schema.json").read_text()))


def test_serve_values_name_real_settings_with_matching_types():
    """Every key under `serve` is a settings knob (camelCase), typed as the knob is."""
    props = json.loads((CHART / "values.schema.json").read_text())["properties"]["serve"]["properties"]
    knobs = {}
    for cls in (ServerSettings, EngineSettings):
        for f, hint in settings_fields(cls):
            head, *tail = f.name.split("_")
            knobs[head + "".join(t.title() for t in tail)] = hint
    assert set(props) <= set(knobs), f"not settings knobs: {set(props) - set(knobs)}"
    assert not {"host", "port", "apiKey"} & set(props), "the chart sets these itself"
    json_type = {bool: "boolean", int: "integer", float: "number", str: "string"}
    for key, prop in props.items():
        hint = knobs[key]
        if get_origin(hint) in (Union, types.UnionType):  # `X | None` -> X
            (hint,) = [a for a in get_args(hint) if a is not type(None)]
        if get_origin(hint) is Literal:
            assert set(prop["enum"]) - {None} == set(get_args(hint)), key
        else:
            assert prop["type"] == [json_type[hint], "null"], key
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["serve"]
    assert set(defaults) == set(props), "values.yaml should list every serve key the schema allows"


# Knobs a `serve` key cannot carry, and why; every other settings knob must be settable.
NOT_SERVE_KEYS = {
    "host": "the image's ENTRYPOINT binds 0.0.0.0",
    "port": "containerPort",
    "apiKey": "apiKey.* (a Secret)",
    "distInitAddr": "multi-node tensor parallelism: one pod per replica here",
    "nnodes": "multi-node tensor parallelism",
    "nodeRank": "multi-node tensor parallelism",
    "disaggregationMode": "pd.enabled sets it per role",
    "disaggregationBootstrapPort": "pd.bootstrapPort",
    "disaggregationTransferBackend": "pd.transferBackend",
    "disaggregationTimeout": "pd.timeout",
}


def _knobs() -> dict[str, object]:
    """camelCase knob name -> its dataclass field, over both settings classes."""
    knobs = {}
    for cls in (ServerSettings, EngineSettings):
        for f, _ in settings_fields(cls):
            head, *tail = f.name.split("_")
            knobs[head + "".join(t.title() for t in tail)] = f
    return knobs


def test_every_settings_knob_is_a_serve_key_or_set_by_the_chart():
    """A knob added to config/settings.py must reach the chart (the schema forbids
    unknown keys, so extraArgs would be the only way), or be named above with a reason."""
    props = json.loads((CHART / "values.schema.json").read_text())["properties"]["serve"]["properties"]
    missing = set(_knobs()) - set(props) - set(NOT_SERVE_KEYS)
    assert not missing, f"settings knobs the chart cannot set: {sorted(missing)}"
    assert not set(NOT_SERVE_KEYS) & set(props)
    assert set(NOT_SERVE_KEYS) <= set(_knobs()), "stale entries in NOT_SERVE_KEYS"


def test_serve_schema_descriptions_are_the_settings_help_lines():
    """One help line per knob: the schema repeats it, so it cannot drift (as a stale
    'Default: 0.88' once did)."""
    props = json.loads((CHART / "values.schema.json").read_text())["properties"]["serve"]["properties"]
    knobs = _knobs()
    for key, prop in props.items():
        assert prop.get("description") == knobs[key].metadata["help"], key


def test_values_yaml_states_the_servers_real_defaults():
    """A `serve` comment that quotes a server default quotes the one the code has."""
    lines = (CHART / "values.yaml").read_text().split("\nserve:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    knobs = _knobs()
    quoted = 0
    for line in lines:
        m = re.match(r"\s+(\w+): .*#.*\bserver default:? (\S+)", line)
        if m:
            key, text = m.groups()
            assert yaml.safe_load(text.strip("(),;")) == knobs[key].default, line
            quoted += 1
    assert quoted, "expected at least one quoted default (enableMetrics)"
    for line in lines:  # a knob whose default is derived must not be given a number
        m = re.match(r"\s+(\w+): ", line)
        if m and m.group(1) in knobs and knobs[m.group(1)].default is None:
            assert not re.search(r"default:? [0-9]", line), line


def test_schema_rejects_a_misspelled_or_out_of_range_flag(chart):
    with pytest.raises(helm.HelmValuesError, match="memFractionStatc"):
        chart.validate_schema({"serve": {"memFractionStatc": 0.8}})
    with pytest.raises(helm.HelmValuesError, match="memFractionStatic"):
        chart.validate_schema({"serve": {"memFractionStatic": 1.5}})


def test_values_validate_against_schema(release, chart):
    merged = release.merged
    chart.validate_schema(merged)  # Helm's validator, as `helm install` runs it
    jsonschema.Draft7Validator(json.loads((CHART / "values.schema.json").read_text())).validate(merged)


def test_helm_lint_strict_is_clean(release):
    values = release.values
    report = helm.lint(CHART, values, strict=True, namespace="llm")
    assert report["errors"] == [], report["messages"]
    assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]


# Subsets of the CRDs' schemas: kubernetes-validate only knows built-in kinds.
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object", "required": ["spec"],
        "properties": {"spec": {"type": "object", "required": ["selector", "endpoints"], "properties": {
            "selector": {"type": "object", "properties": {"matchLabels": {"type": "object"}}},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["port", "path"],
                "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                               "interval": {"type": "string", "pattern": "^[0-9]+[smh]$"},
                               "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+[smh]$"}}}}}}}},
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object", "required": ["spec"],
        "properties": {"spec": {"type": "object", "required": ["scaleTargetRef", "triggers"], "properties": {
            "scaleTargetRef": {"type": "object", "required": ["name"]},
            "minReplicaCount": {"type": "integer"}, "maxReplicaCount": {"type": "integer"},
            "pollingInterval": {"type": "integer"}, "cooldownPeriod": {"type": "integer"},
            "triggers": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["type", "metadata"],
                "properties": {"type": {"const": "prometheus"}, "metadata": {
                    "type": "object", "required": ["serverAddress", "query", "threshold"],
                    "additionalProperties": {"type": "string"}}}}}}}}},
}


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(release, kube_version):
    objects = release.objects
    assert {"Deployment", "Service"} <= {o["kind"] for o in objects}
    for obj in objects:
        crd = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        if crd:
            jsonschema.validate(obj, crd)
        else:  # strict: unknown fields are errors, as `kubectl apply --validate=strict`
            kubernetes_validate.validate(obj, kube_version, strict=True)


def test_rendered_objects_reference_each_other(release):
    merged, objects = release.merged, release.objects
    by_kind = {}
    for o in objects:
        by_kind.setdefault(o["kind"], []).append(o)
    deploy = _one(objects, "Deployment")
    pod = deploy["spec"]["template"]
    pod_labels = pod["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget"):
        for o in by_kind.get(kind, []):
            sel = o["spec"]["selector"]
            sel = sel.get("matchLabels", sel)
            assert sel.items() <= pod_labels.items(), f"{kind} selects no pod"
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service = _one(objects, "Service")
    for sm in by_kind.get("ServiceMonitor", []):
        assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    for scaler in by_kind.get("HorizontalPodAutoscaler", []) + by_kind.get("ScaledObject", []):
        assert scaler["spec"]["scaleTargetRef"]["name"] == deploy["metadata"]["name"]
        assert "replicas" not in deploy["spec"], "an autoscaled Deployment must leave replicas to the scaler"
    names = lambda kind: {o["metadata"]["name"] for o in by_kind.get(kind, [])}  # noqa: E731
    for vol in pod["spec"]["volumes"]:
        if "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]["claimName"]
            assert claim in names("PersistentVolumeClaim") | {merged["modelStorage"]["persistence"]["existingClaim"]}
    sa = pod["spec"]["serviceAccountName"]
    assert sa in names("ServiceAccount")
    for env in _container(objects)["env"]:
        ref = env.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            assert ref["name"] in names("Secret") | {merged["apiKey"]["existingSecret"]}


def test_no_template_leaks_nil_or_none(release):
    objects, notes = release.objects, release.notes
    text = yaml.safe_dump_all(objects) + notes
    assert "<nil>" not in text and "None" not in text and "%!" not in text


# ----------------------------------------------------- chart args -> sluice serve


def test_pod_command_line_is_accepted_by_sluice_serve(release):
    """ENTRYPOINT + the rendered args parse and validate; every value round-trips."""
    name, merged, objects = release.name, release.merged, release.objects
    container = _container(objects)
    target = "cpu" if container["image"].endswith("-cpu") else "cuda"
    entrypoint = _exec_form(_dockerfile_stages()[target], "ENTRYPOINT")
    args = container["args"]
    env_names = {e["name"] for e in container["env"]}
    for ref in re.findall(r"\$\((\w+)\)", " ".join(args)):
        assert ref in env_names, f"$({ref}) would not be expanded by Kubernetes"
    argv = entrypoint[2:] + [a.replace(API_KEY_VAR, "dummy-key") for a in args]
    try:
        ns = build_serve_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"`sluice serve` rejects the {name} pod's args: {argv}")
    engine, server = settings_from_args(ns)  # raises SettingsError on a bad value
    assert server.host == "0.0.0.0"
    assert server.port == merged["containerPort"] == container["ports"][0]["containerPort"]
    for key, value in merged["serve"].items():
        field = re.sub(r"[A-Z]", lambda m: "_" + m.group().lower(), key)
        got = getattr(engine if hasattr(engine, field) else server, field)
        assert got == value, f"serve.{key}={value!r} reached the server as {got!r}"
    assert (server.api_key == "dummy-key") == bool(merged["apiKey"]["existingSecret"] or merged["apiKey"]["value"])


def test_api_key_comes_from_a_secret_never_the_pod_spec(release):
    merged, objects = release.merged, release.objects
    container = _container(objects)
    if not (merged["apiKey"]["value"] or merged["apiKey"]["existingSecret"]):
        assert "--api-key" not in container["args"]
        return
    assert container["args"][container["args"].index("--api-key") + 1] == API_KEY_VAR
    (env,) = [e for e in container["env"] if e["name"] == "SLUICE_API_KEY"]
    assert env["valueFrom"]["secretKeyRef"]["key"] == merged["apiKey"]["secretKey"]
    deploy_text = yaml.safe_dump(_one(objects, "Deployment"))
    if merged["apiKey"]["value"]:
        assert merged["apiKey"]["value"] not in deploy_text


def test_grace_period_covers_prestop_and_drain(release):
    merged, objects = release.merged, release.objects
    pod = _one(objects, "Deployment")["spec"]["template"]["spec"]
    sleep = int(pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1])
    assert sleep == merged["preStopSleepSeconds"]
    drain = merged["serve"].get("gracefulShutdownTimeout", 30)
    assert pod["terminationGracePeriodSeconds"] >= sleep + drain + 5


def test_probes_hit_health_on_the_served_port(release):
    objects = release.objects
    container = _container(objects)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["ports"][0]["name"] == "http"


def test_gpu_requests_and_image_follow_the_values(release):
    merged, objects = release.merged, release.objects
    container = _container(objects)
    pod = _one(objects, "Deployment")["spec"]["template"]["spec"]
    gpus = merged["gpu"]["count"]
    res = container.get("resources", {})
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    for kind, amounts in (merged["resources"] or {}).items():
        assert res[kind].items() >= amounts.items(), f"resources.{kind} must reach the pod as given"
    if gpus:
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == gpus
        assert container["image"] == f"sluice:{app_version}"
    else:
        assert "nvidia.com/gpu" not in json.dumps(res)
        assert container["image"] == f"sluice:{app_version}-cpu", "a GPU-less pod should run the CPU image"
    (shm,) = [v for v in pod["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_named_values_files_say_what_they_promise():
    cpu = yaml.safe_load((CHART / "values-cpu.yaml").read_text())
    assert cpu["serve"]["device"] == "cpu" and cpu["gpu"]["count"] == 0
    assert "modelPath" not in cpu["serve"], "the CPU values serve the embedded default model"
    llama = yaml.safe_load((CHART / "values-gpu-llama3-8b.yaml").read_text())
    assert llama["serve"]["modelPath"] == "/models/Meta-Llama-3-8B-Instruct"
    assert llama["serve"]["memFractionStatic"] == 0.88 and llama["gpu"]["count"] == 1


def test_notes_show_a_chat_completion_call(release):
    merged, notes = release.merged, release.notes
    assert "port-forward svc/demo-sluice" in notes
    assert "/v1/chat/completions" in notes
    if merged["apiKey"]["value"] or merged["apiKey"]["existingSecret"]:
        assert "Authorization: Bearer $SLUICE_API_KEY" in notes


def test_readme_documents_every_value_and_the_docker_runs():
    readme = (CHART / "README.md").read_text()
    table = readme[readme.index("## Values"):readme.index("## Docker")]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    kubernetes_shaped = {"serve", "startupProbe", "livenessProbe", "readinessProbe", "strategy",
                         "podSecurityContext", "securityContext"}  # documented by reference
    for key, value in values.items():
        assert f"`{key}" in table, f"values key {key} missing from the README table"
        for sub in value if isinstance(value, dict) and key not in kubernetes_shaped else ():
            assert sub in table, f"{key}.{sub} missing from the README table"
    assert "--gpus all" in readme and "--ipc=host" in readme and "--target cpu" in readme
