"""infra/: the KubeRay manifests against the vendored CRD schemas (jsonschema) and their core
Kubernetes objects against kubernetes-validate's offline schemas; the job and serving files
they embed against the project's own config models; the Airflow DAG file loads."""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pipeline.job import JobSpec
from serving.config import config_from_mapping

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "infra" / "k8s"
CRDS = K8S / "crds"
KUBERNETES_VERSION = "1.33"
MANIFESTS = ["rayjob.yaml", "rayservice.yaml", "raycluster.yaml"]


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def crd_schema(kind: str) -> dict:
    """The CRD's schema, strict: the API server prunes unknown fields silently, so a misspelt
    key would vanish there; here it is an error (unless the schema preserves unknown fields)."""
    return strict(json.loads((CRDS / f"{kind.lower()}.v1.json").read_text()))


def strict(node: object) -> object:
    if isinstance(node, list):
        return [strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: strict(value) for key, value in node.items() if key != "properties"}
    if "properties" in node:
        out["properties"] = {key: strict(value) for key, value in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
    return out


def crd_errors(document: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(crd_schema(document["kind"]))
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(document)
    ]


def pod_templates(document: dict) -> list[dict]:
    spec = document["spec"]
    cluster = spec.get("rayClusterSpec") or spec.get("rayClusterConfig") or spec
    groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
    return [group["template"] for group in groups]


def as_pod(template: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"}, **template}


def core_errors(document: dict) -> list[str]:
    try:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [str(error)]
    return []


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifests_validate(name: str) -> None:
    ray_kinds = 0
    for document in documents(name):
        if document["apiVersion"] == "ray.io/v1":
            ray_kinds += 1
            assert crd_errors(document) == []
            for template in pod_templates(document):
                assert core_errors(as_pod(template)) == []
        else:
            assert core_errors(document) == []
    assert ray_kinds == 1


def test_kubernetes_validate_works_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    def no_network(*args: object, **kwargs: object) -> None:
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    (configmap,) = [d for d in documents("rayjob.yaml") if d["kind"] == "ConfigMap"]
    assert core_errors(configmap) == []


def test_broken_manifests_fail() -> None:
    (job,) = [d for d in documents("rayjob.yaml") if d["kind"] == "RayJob"]
    broken = copy.deepcopy(job)
    broken["spec"]["shutdownAfterJobFinish"] = True  # misspelt
    broken["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "four"
    assert len(crd_errors(broken)) == 2
    pod = as_pod(pod_templates(job)[1])
    pod["spec"]["containers"][0]["resources"]["limits"]["memory"] = {"a": 1}
    pod["spec"]["containers"][0]["imagePullPolicy"] = 3
    assert core_errors(pod) != []
    misspelt = as_pod(pod_templates(job)[0])
    misspelt["spec"]["containers"][0]["envFrom"] = [{"secretref": {"name": "x"}}]
    assert core_errors(misspelt) != []  # strict: unknown fields fail


def embedded(name: str, key: str) -> dict:
    (configmap,) = [d for d in documents(name) if d["kind"] == "ConfigMap"]
    return yaml.safe_load(configmap["data"][key])


def test_the_rayjob_job_file_is_a_job() -> None:
    spec = JobSpec.from_dict(embedded("rayjob.yaml", "job.yaml"))
    assert spec.concurrency.num_gpus == 1
    assert spec.state_store.startswith("postgresql")
    assert spec.sources[0].startswith("s3://") and spec.output.uri.startswith("s3://")
    (job,) = [d for d in documents("rayjob.yaml") if d["kind"] == "RayJob"]
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert workers["maxReplicas"] >= spec.concurrency.actors  # a GPU per actor
    assert workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]


def test_the_rayservice_serving_file_is_a_serving_config() -> None:
    config = config_from_mapping(embedded("rayservice.yaml", "serving.yaml"))
    assert config.keys_required and config.auth.api_keys == ()
    assert config.engine_deployment.autoscaling is not None
    (service,) = [d for d in documents("rayservice.yaml") if d["kind"] == "RayService"]
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert serve["applications"][0]["import_path"] == "serving.app:app_builder"
    head = pod_templates(service)[0]["spec"]["containers"][0]
    for probe in ("readinessProbe", "livenessProbe"):
        assert head[probe]["httpGet"]["path"] == "/healthz"
    names = {e["name"]: e for e in head["env"]}
    assert "secretKeyRef" in names[config.auth.api_keys_env]["valueFrom"]


def test_the_cluster_launcher_file_parses() -> None:
    launcher = yaml.safe_load((K8S / "cluster-launcher.yaml").read_text())
    assert launcher["head_node_type"] in launcher["available_node_types"]


def test_the_rayservice_import_path_builds_the_app_and_refuses_to_without_keys(
    tmp_path: Path, test_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ray.serve import Application

    from serving.config import ConfigError

    (service,) = [d for d in documents("rayservice.yaml") if d["kind"] == "RayService"]
    (application,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    module, _, name = application["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), name)
    serving = embedded("rayservice.yaml", "serving.yaml")
    serving["engine"]["model"] = test_model_path  # the manifest's model is not pulled here
    config_file = tmp_path / "serving.yaml"
    config_file.write_text(yaml.safe_dump(serving))
    env = serving.get("auth", {}).get("api_keys_env", "MEMSTREAM_API_KEYS")
    monkeypatch.delenv(env, raising=False)
    with pytest.raises(ConfigError, match="refusing to start without API keys"):
        builder({**application["args"], "config": str(config_file)})
    monkeypatch.setenv(env, "k" * 24)
    assert isinstance(builder({**application["args"], "config": str(config_file)}), Application)
