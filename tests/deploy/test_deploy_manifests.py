"""Kubernetes manifests, the Helm chart and the Ray cluster config, checked with real validators.

- Core Kubernetes kinds: kubernetes-validate (the Kubernetes OpenAPI schemas, offline, strict).
- RayCluster / ServiceMonitor / ScrapeConfig: crd_schemas.py (their own fields) + every embedded Pod
  template against Kubernetes' PodTemplateSpec schema.
- Helm: rendered by Helm's Go SDK through helm-python-sdk (no `helm` binary exists as a
  Debian or PyPI package here); skipped when that package is missing.
- cluster.yaml: Ray's own ray-schema.json plus Ray's prepare_config/validate_config.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from crd_schemas import CRD_SCHEMAS
from deploy_checks import DEPLOY

try:
    import kubernetes_validate as kv
except ImportError:  # the schema checks below that need it skip
    kv = None
needs_kv = pytest.mark.skipif(kv is None, reason="pip package kubernetes-validate missing")

K8S_VERSION = "1.33.0"
CHART = DEPLOY / "helm" / "pdserve"


def pod_templates(doc: dict) -> list[dict]:
    if doc["kind"] != "RayCluster":
        return []
    spec = doc["spec"]
    workers = [g["template"] for g in spec.get("workerGroupSpecs", [])]
    return [spec["headGroupSpec"]["template"], *workers]


def validate_manifest(doc: dict) -> None:
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRD_SCHEMAS:
        jsonschema.Draft202012Validator(CRD_SCHEMAS[key]).validate(doc)
        for tmpl in pod_templates(doc):
            kv.validate({"apiVersion": "v1", "kind": "PodTemplate",
                         "metadata": {"name": "check"}, "template": tmpl}, K8S_VERSION, strict=True)
    else:
        kv.validate(doc, K8S_VERSION, strict=True)


def load_docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def check_wiring(docs: list[dict]) -> None:
    """What the validators can't see: the objects point at each other correctly."""
    kinds = by_kind(docs)
    [rc] = kinds["RayCluster"]
    name = rc["metadata"]["name"]
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head = rc["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    [c] = head["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    cmd = c["args"][0]
    assert "${KUBERAY_GEN_RAY_START_CMD//--block/}" in cmd and "exec pdserve serve" in cmd
    assert "--address auto" in cmd and "--host 0.0.0.0" in cmd
    # the router Service selects the head pod by the labels KubeRay gives it
    router = next(s for s in kinds["Service"] if "router" in s["metadata"]["name"])
    assert router["spec"]["selector"] == {"ray.io/cluster": name, "ray.io/node-type": "head"}
    assert {p["targetPort"] for p in router["spec"]["ports"]} <= set(ports)
    # pool sizes: --prefill/--decode = pods x GPUs per pod / the pool's TP size, which
    # divides a pod's GPUs (a worker's ranks are placed together)
    for g in rc["spec"]["workerGroupSpecs"]:
        [wc] = g["template"]["spec"]["containers"]
        gpus = int(wc["resources"]["limits"]["nvidia.com/gpu"])
        tp = int(re.search(rf"--{g['groupName']}-tp (\d+)\b", cmd).group(1))
        assert gpus % tp == 0, (g["groupName"], gpus, tp)
        assert re.search(rf"--{g['groupName']} {g['replicas'] * gpus // tp}\b", cmd), cmd
        assert "$KUBERAY_GEN_RAY_START_CMD" in wc["args"][0]
    # the API key comes from a Secret (rendered here, or named by the user)
    env = {e["name"]: e for e in c.get("env", [])}
    if "PDSERVE_API_KEY" in env:
        ref = env["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert '--api-key "$PDSERVE_API_KEY"' in cmd
        for s in kinds.get("Secret", []):
            if s["metadata"]["name"] == ref["name"]:
                assert ref["key"] in s["data"]


@needs_kv
def test_kuberay_manifest_validates():
    docs = load_docs((DEPLOY / "kuberay" / "raycluster.yaml").read_text())
    assert sorted(by_kind(docs)) == ["RayCluster", "Service"]
    for doc in docs:
        validate_manifest(doc)
    check_wiring(docs)


@needs_kv
def test_validators_reject_broken_manifests():
    """The validators are real: typical mistakes fail."""
    [rc, svc] = load_docs((DEPLOY / "kuberay" / "raycluster.yaml").read_text())
    bad = copy.deepcopy(rc)
    bad["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] = 0  # must be a string
    with pytest.raises(jsonschema.ValidationError):
        validate_manifest(bad)
    bad = copy.deepcopy(rc)
    bad["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["ports"] = [
        {"containerPort": "eighty"}]
    with pytest.raises(kv.ValidationError):
        validate_manifest(bad)
    bad = copy.deepcopy(svc)
    bad["spec"]["ports"][0]["prot"] = 8000  # unknown field: strict mode
    with pytest.raises(kv.ValidationError):
        validate_manifest(bad)


def test_values_validate_against_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    validator = jsonschema.Draft7Validator(schema)
    validator.validate(values)
    for path, bad in ((("prefill", "replicas"), -1), (("decode", "replicas"), 0),
                      (("decode", "gpusPerWorker"), "2"), (("apiKey", "enabled"), "yes"),
                      (("router", "service", "type"), "Ingress"), (("image", "repository"), "")):
        v = copy.deepcopy(values)
        node = v
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = bad
        assert not validator.is_valid(v), path
    assert not validator.is_valid({**values, "replicaCount": 3})  # typo'd / unknown key


def test_ray_cluster_yaml_against_ray_schema():
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    schema_path = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    jsonschema.validate(config, json.loads(schema_path.read_text()))
    validate_config(prepare_config(copy.deepcopy(config)))
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"]["GPU"] == 0  # router only
    assert {t["labels"]["pdserve-role"] for t in types.values()} == {"router", "prefill", "decode"}
    assert "--env RAY_AUTH_MODE=token" in config["docker"]["run_options"]
    assert "/home/ray/.ray/auth_token" in config["file_mounts"]
    assert "--dashboard-host=127.0.0.1" in " ".join(config["head_start_ray_commands"])
    bad = copy.deepcopy(config)
    bad["available_node_types"]["decode_gpu"]["min_workers"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, json.loads(schema_path.read_text()))


# --- Helm ----------------------------------------------------------------------------------

def _render(values: dict) -> list[dict]:
    helm = pytest.importorskip(
        "helm_python", reason="helm-python-sdk (Helm's Go SDK) missing; no helm binary here")
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
        rendered = chart.render(values, name="llm", namespace="serving")
    return [d for name, text in rendered.items() if not name.endswith("NOTES.txt")
            for d in load_docs(text)]


@needs_kv
def test_helm_chart_renders_and_validates_with_defaults():
    docs = _render({})
    kinds = by_kind(docs)
    assert sorted(kinds) == ["PodDisruptionBudget", "RayCluster", "ScrapeConfig", "Secret",
                             "Service", "ServiceMonitor"]
    # the API key and the cluster secret; the router reads the latter as a mounted file
    assert sorted(len(next(iter(s["data"].values()))) > 40 for s in kinds["Secret"]) == [True] * 2
    [rc] = kinds["RayCluster"]
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    [mount] = [m for m in head["containers"][0]["volumeMounts"] if m["name"] == "cluster-secret"]
    [vol] = [v for v in head["volumes"] if v["name"] == "cluster-secret"]
    assert vol["secret"]["secretName"] in {s["metadata"]["name"] for s in kinds["Secret"]}
    assert f"--cluster-secret-file {mount['mountPath']}/secret" in head["containers"][0]["args"][0]
    # readable by the image's non-root user (rayproject/ray's `ray`, group 100) and no other:
    # a root-only 0400 file failed `pdserve serve` in such an image
    assert vol["secret"]["defaultMode"] == 0o440 and head["securityContext"]["fsGroup"] == 100
    for doc in docs:
        validate_manifest(doc)
    check_wiring(docs)
    [rc], [svc], [sm] = kinds["RayCluster"], kinds["Service"], kinds["ServiceMonitor"]
    # the ServiceMonitor scrapes the router Service's named port
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    # the workers' own /metrics, found through the router Service's /metrics/targets
    [sc] = kinds["ScrapeConfig"]
    [sd] = sc["spec"]["httpSDConfigs"]
    http = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http")
    assert sd["url"] == f"http://{svc['metadata']['name']}.serving.svc:{http}/metrics/targets"
    # one PDB per GPU pool, selecting that worker group's pods
    groups = {g["groupName"] for g in rc["spec"]["workerGroupSpecs"]}
    pdb_groups = {p["spec"]["selector"]["matchLabels"]["ray.io/group"]
                  for p in kinds["PodDisruptionBudget"]}
    assert pdb_groups == groups == {"prefill", "decode"}
    assert all(p["spec"]["selector"]["matchLabels"]["ray.io/cluster"] == rc["metadata"]["name"]
               for p in kinds["PodDisruptionBudget"])


@needs_kv
def test_helm_values_drive_the_cluster():
    docs = _render({"model": "/models/qwen3-8b", "prefill": {"replicas": 3, "gpusPerWorker": 8},
                    "decode": {"replicas": 2, "gpusPerWorker": 4},
                    "apiKey": {"enabled": True, "existingSecret": "my-key", "secretKey": "token"},
                    "clusterSecret": {"existingSecret": "my-cluster-secret"},
                    "metrics": {"serviceMonitor": {"enabled": False}},
                    "extraServeArgs": ["--speculative", "mtp"]})
    kinds = by_kind(docs)
    assert "Secret" not in kinds and "ServiceMonitor" not in kinds and "ScrapeConfig" not in kinds
    for doc in docs:
        validate_manifest(doc)
    check_wiring(docs)
    [rc] = kinds["RayCluster"]
    [head] = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    cmd = head["args"][0]
    assert "--prefill 24 --decode 8" in cmd and '--model "/models/qwen3-8b"' in cmd
    assert cmd.endswith('"--speculative" "mtp"')
    assert head["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "my-key", "key": "token"}
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert groups["prefill"]["replicas"] == 3
    assert groups["prefill"]["rayStartParams"]["num-gpus"] == "8"


@needs_kv
def test_helm_tensor_parallel_pools():
    """tensorParallelSize per pool: --prefill-tp / --decode-tp, and the pools count workers
    of that many GPUs; a size that does not divide a pod's GPUs fails, naming the value."""
    docs = _render({"prefill": {"replicas": 3, "gpusPerWorker": 8, "tensorParallelSize": 2},
                    "decode": {"replicas": 2, "gpusPerWorker": 4, "tensorParallelSize": 4}})
    for doc in docs:
        validate_manifest(doc)
    check_wiring(docs)
    [rc] = by_kind(docs)["RayCluster"]
    cmd = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "--prefill 12 --decode 2 --prefill-tp 2 --decode-tp 4" in cmd
    assert "--worker-host node --node-label pdserve-role" in cmd  # multi-node wiring
    assert {g["groupName"]: g["rayStartParams"]["labels"] for g in rc["spec"]["workerGroupSpecs"]} \
        == {"prefill": "pdserve-role=prefill", "decode": "pdserve-role=decode"}
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk missing")
    with pytest.raises(helm.HelmError, match="decode.tensorParallelSize: 3 does not divide"):
        _render({"decode": {"replicas": 1, "gpusPerWorker": 8, "tensorParallelSize": 3}})
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmError, match="tensorParallelSize"):
            chart.validate_schema({"prefill": {"replicas": 1, "gpusPerWorker": 8,
                                               "tensorParallelSize": 0}})


def test_documented_serve_commands_parse_and_fit_the_nodes():
    """The `pdserve serve` lines in cluster.yaml's header and the KubeRay manifest are valid
    commands (the real parser and its checks), and each TP size divides a node's 8 GPUs."""
    from pdserve.router.cli import build_parser
    from pdserve.router.serve_args import check_serve_args as _check

    texts = [(DEPLOY / "ray" / "cluster.yaml").read_text(),
             (DEPLOY / "kuberay" / "raycluster.yaml").read_text()]
    lines = []
    for text in texts:
        flat = re.sub(r"\s*\\?\n\s*#?\s*", " ", text)  # comment lines, continuations
        lines += re.findall(r"pdserve serve (--address auto(?: --(?!api-key)[\w-]+"
                            r"(?: (?!--)[\w./-]+)?)*)", flat)
    assert len(lines) == 2, lines
    for line in lines:
        args = build_parser().parse_args(["serve", *line.split()])
        assert _check(args) is None, line
        assert 8 % args.prefill_tp == 0 and 8 % args.decode_tp == 0, line
        # workers on other nodes than the router: each advertises its node's address, and
        # each pool stays on the node group labelled for it
        assert args.worker_host == "node" and args.node_label == "pdserve-role", line
    assert any("--decode-tp 4" in line for line in lines)


def test_helm_rejects_values_outside_the_schema():
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk missing")
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmError, match="replicas"):
            chart.validate_schema({"decode": {"replicas": 0, "gpusPerWorker": 1}})


def test_helm_lint_is_clean():
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk missing")
    result = helm.lint(str(CHART))
    assert result["errors"] == []
    assert [m for m in result["messages"] if m["severity"] > 1] == []  # only INFO findings
