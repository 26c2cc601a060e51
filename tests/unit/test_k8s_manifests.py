"""deploy/k8s: every manifest validates against the Kubernetes and KEDA schemas, and what the
manifests say about rein (queue keys, settings, the worker the ScaledObject scales) is what
rein's own code says, so a rename in rein breaks this test rather than the autoscaling.

Kubernetes objects: kubernetes-validate's bundled JSON schemas (offline), strict (an unknown
field is an error, as `kubectl apply --validate=strict` makes it). KEDA's ScaledObject and
TriggerAuthentication: the openAPIV3Schema of KEDA's CRDs (tests/unit/schemas/, whose
`$comment` names the release), made strict the same way, with jsonschema. Where `kubectl` is
installed, `kubectl kustomize` builds both variants (base, prometheus) and what it renders is
checked the same way.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kombu.transport.redis import Channel

from rein.core.messages import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from rein.core.settings import Settings, load_settings
from rein.jobs.queues import queue_keys, queued_slots

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s" / "base"
OVERLAY = K8S.parent / "prometheus"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
# The oldest Kubernetes release still supported upstream when this was written, and the
# newest kubernetes-validate bundles: the manifests use nothing newer than the first.
KUBERNETES_VERSIONS = ("1.31", kubernetes_validate.latest_version())
KEDA_KINDS = ("ScaledObject", "TriggerAuthentication")
# The trigger metadata KEDA's scalers read (pkg/scalers/redis_scaler.go and prometheus_scaler.go,
# v2.20.2): the CRD types it as a map of strings, so a misspelt key would pass the schema.
SCALER_METADATA = {
    "redis": {"address", "host", "port", "listName", "listLength", "activationListLength", "databaseIndex",
              "enableTLS", "unsafeSsl", "addressFromEnv", "hostFromEnv", "portFromEnv", "usernameFromEnv",
              "passwordFromEnv"},
    "prometheus": {"serverAddress", "query", "threshold", "activationThreshold", "namespace", "ignoreNullValues",
                   "unsafeSsl", "timeout", "queryParameters", "customHeaders"},
}
REQUIRED_METADATA = {"redis": {"listName"}, "prometheus": {"serverAddress", "query", "threshold"}}


def load_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifest_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.yaml") if p.name != "kustomization.yaml")


MANIFESTS = {path.name: load_documents(path) for path in manifest_files(K8S)}
DOCUMENTS = [doc for docs in MANIFESTS.values() for doc in docs]


def strict(schema: object) -> object:
    """The schema with `additionalProperties: false` on every object that lists its properties
    and says nothing of others (the API server prunes or refuses unknown fields of a CRD)."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


def keda_validator(kind: str) -> jsonschema.Draft7Validator:
    schema = json.loads((SCHEMAS / f"keda-{kind.lower()}-v1alpha1.json").read_text())
    return jsonschema.Draft7Validator(strict(schema))


def validate(doc: dict) -> None:
    if doc["apiVersion"] == "keda.sh/v1alpha1":
        assert doc["kind"] in KEDA_KINDS, f"no KEDA schema vendored for {doc['kind']}"
        keda_validator(doc["kind"]).validate(doc)
        if doc["kind"] == "ScaledObject":
            spec = doc["spec"]   # the CRD's CEL rule, which jsonschema cannot run
            assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100)
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def merge_patch(target: object, patch: object) -> object:
    """RFC 7386 JSON merge patch: how kustomize applies a patch to a custom resource, whose
    lists it cannot merge by key (a list is replaced whole, null removes a field)."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


def find(kind: str, name: str | None = None, docs: list[dict] = DOCUMENTS) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def the(kind: str, name: str | None = None) -> dict:
    (doc,) = find(kind, name)
    return doc


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def container_env(container: dict) -> dict[str, str]:
    """The environment a container gets: its ConfigMaps' and Secrets' keys, then its own env."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(the("ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            env.update(the("Secret", source["secretRef"]["name"])["stringData"])
    env.update({item["name"]: item["value"] for item in container.get("env", []) if "value" in item})
    return env


def rein_containers() -> list[tuple[dict, dict]]:
    return [(doc, container) for doc in DOCUMENTS if doc["kind"] in ("Deployment", "Job")
            for container in pod_spec(doc)["containers"]]


def settings_of(container: dict, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """rein's settings as this container would read them (load_settings parses every value)."""
    for name, value in container_env(container).items():
        monkeypatch.setenv(name, value)
    return load_settings()


@pytest.fixture()
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    import os

    for name in list(os.environ):
        if name.startswith("REIN_"):
            monkeypatch.delenv(name)
    return monkeypatch


def worker_model(deployment: dict) -> str:
    (container,) = pod_spec(deployment)["containers"]
    args = container["args"]
    assert args[0] == "worker" and "--model" in args, args
    return args[args.index("--model") + 1]


# -- schemas ------------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_validates(doc: dict) -> None:
    validate(doc)


def test_the_validators_refuse_unknown_and_mistyped_fields() -> None:
    deployment = copy.deepcopy(the("Deployment", "rein-api"))
    deployment["spec"]["replica"] = 2     # a typo of replicas
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    scaled = copy.deepcopy(the("ScaledObject"))
    scaled["spec"]["triggers"][0]["metdata"] = scaled["spec"]["triggers"][0].pop("metadata")
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)
    scaled = copy.deepcopy(the("ScaledObject"))
    scaled["spec"]["maxReplicaCount"] = "8"
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)


def test_the_prometheus_overlay_validates_once_applied() -> None:
    (kustomization,) = load_documents(OVERLAY / "kustomization.yaml")
    assert kustomization["resources"] == ["../base"]
    for entry in kustomization["patches"]:
        (patch,) = load_documents(OVERLAY / entry["path"])
        (base,) = find(patch["kind"], patch["metadata"]["name"])
        patched = merge_patch(base, patch)
        validate(patched)
        check_triggers(patched)


# -- the kustomization -----------------------------------------------------------------------------


def test_the_kustomization_lists_every_manifest_and_names_every_image() -> None:
    (kustomization,) = load_documents(K8S / "kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(MANIFESTS)
    images = {image["name"] for image in kustomization["images"]}
    used = {container["image"] for _, container in rein_containers()}
    assert used == images, "every rein container's image is one the kustomization sets, and no other"


# -- what the manifests say about rein ------------------------------------------------------------


def check_triggers(scaled: dict) -> None:
    names = [trigger["name"] for trigger in scaled["spec"]["triggers"]]
    formula = scaled["spec"]["advanced"]["scalingModifiers"]["formula"]
    assert sorted(formula.replace("+", " ").split()) == sorted(names), (formula, names)
    for trigger in scaled["spec"]["triggers"]:
        metadata = trigger["metadata"]
        assert set(metadata) <= SCALER_METADATA[trigger["type"]], trigger
        assert REQUIRED_METADATA[trigger["type"]] <= set(metadata), trigger


def test_the_scaled_object_scales_the_worker_on_its_models_queues(clean_env: pytest.MonkeyPatch) -> None:
    scaled = the("ScaledObject")
    target = scaled["spec"]["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment"
    deployment = the("Deployment", target["name"])
    model = worker_model(deployment)
    (container,) = pod_spec(deployment)["containers"]
    settings = settings_of(container, clean_env)
    assert settings.served_model(model) is not None, f"the worker's model {model!r} is not in REIN_MODELS"

    check_triggers(scaled)
    lists = {trigger["name"]: trigger["metadata"]["listName"] for trigger in scaled["spec"]["triggers"]}
    keys = queue_keys(settings, model)
    # What rein's broker writes: kombu's list per priority step of each queue, and its hash of
    # taken, unacknowledged messages, all under the prefix (kombu's global_keyprefix).
    assert lists == {"interactive": keys[PRIORITY_INTERACTIVE], "batch": keys[PRIORITY_BATCH],
                     "in_flight": settings.redis_key_prefix + Channel.unacked_key}
    database = int(urlparse(settings.redis_url).path.lstrip("/") or 0)
    assert {t["metadata"]["databaseIndex"] for t in scaled["spec"]["triggers"]} == {str(database)}

    # The target per worker is what one worker holds, as rein computes it from its settings.
    per_worker = settings.max_num_seqs + queued_slots(settings)
    assert scaled["spec"]["advanced"]["scalingModifiers"]["target"] == str(per_worker)
    assert {t["metadata"]["listLength"] for t in scaled["spec"]["triggers"]} == {str(per_worker)}

    authentication = the("TriggerAuthentication", scaled["spec"]["triggers"][0]["authenticationRef"]["name"])
    for ref in authentication["spec"]["secretTargetRef"]:
        assert ref["key"] in the("Secret", ref["name"])["stringData"]


def test_the_prometheus_queries_name_the_workers_model(clean_env: pytest.MonkeyPatch) -> None:
    (patch,) = load_documents(OVERLAY / "scaledobject-triggers.yaml")
    model = worker_model(the("Deployment", the("ScaledObject")["spec"]["scaleTargetRef"]["name"]))
    queries = [trigger["metadata"]["query"] for trigger in patch["spec"]["triggers"]]
    assert all(f'model_name="{model}"' in query for query in queries)
    assert any("rein:queue_depth" in query for query in queries)


def test_every_rein_variable_is_a_setting_and_parses(clean_env: pytest.MonkeyPatch) -> None:
    known = {f"REIN_{name.upper()}" for name in Settings.model_fields}
    for doc, container in rein_containers():
        env = container_env(container)
        unknown = sorted(set(env) - known)
        assert not unknown, f"{doc['metadata']['name']}: not rein settings: {unknown}"
        with clean_env.context() as patch:
            settings_of(container, patch)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) is not installed")
@pytest.mark.parametrize("variant", [K8S, OVERLAY], ids=lambda path: path.name)
def test_kustomize_builds_each_variant(variant: Path) -> None:
    built = subprocess.run(["kubectl", "kustomize", str(variant)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    docs = [doc for doc in yaml.safe_load_all(built.stdout) if doc]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == \
        sorted((d["kind"], d["metadata"]["name"]) for d in DOCUMENTS)
    (kustomization,) = load_documents(K8S / "kustomization.yaml")
    images = {f"{image['newName']}:{image['newTag']}" for image in kustomization["images"]}
    for doc in docs:
        validate(doc)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == kustomization["namespace"]
        if doc["kind"] in ("Deployment", "Job"):
            assert {c["image"] for c in pod_spec(doc)["containers"]} <= images
    (scaled,) = find("ScaledObject", docs=docs)
    check_triggers(scaled)
