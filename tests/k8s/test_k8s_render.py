"""Every overlay renders, and everything it renders validates offline: built-in kinds with
`kubernetes-validate --strict`, custom resources against the CRD schemas in k8s/schemas/."""
from __future__ import annotations

import copy
import json
import subprocess

import jsonschema
import pytest
import yaml
from k8s_manifests import CUSTOM_SCHEMAS, OVERLAYS, render, render_text, tool


def _kubernetes_validate(text: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", "-"], input=text,
                          capture_output=True, text=True, timeout=120, check=False)


def _strict(schema):
    """A CRD schema as the API server applies it with strict field validation: an object
    that lists its properties takes no others (unless it says it keeps unknown fields)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(x) for x in schema]
    return schema


def _validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    schema = json.loads(CUSTOM_SCHEMAS[(api_version, kind)].read_text())
    # metadata is the API server's to check (ObjectMeta); everything else is the CRD's.
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(_strict(schema))


def _custom(docs):
    return [d for d in docs if (d["apiVersion"], d["kind"]) in CUSTOM_SCHEMAS]


@pytest.mark.parametrize("path", ["base"] + [f"overlays/{o}" for o in OVERLAYS])
def test_renders_and_builtin_kinds_validate_strictly(path):
    result = _kubernetes_validate(render_text(path))
    assert result.returncode == 0, result.stdout + result.stderr
    # kubernetes-validate only warns about a kind it has no schema for: each such kind
    # must be one whose schema this repository keeps.
    skipped = {line for line in result.stdout.splitlines() if line.startswith("WARN")}
    custom_kinds = {kind for _, kind in CUSTOM_SCHEMAS}
    for line in skipped:
        assert any(f"kind {kind} " in line for kind in custom_kinds), line


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_custom_resources_validate_against_kept_crd_schemas(overlay):
    custom = _custom(render(overlay))
    if overlay != "cpu-dev":          # h100 autoscales (KEDA); inference-extension adds a pool
        assert custom, f"{overlay} renders no custom resources"
    for doc in custom:
        errors = list(_validator(doc["apiVersion"], doc["kind"]).iter_errors(doc))
        assert not errors, f"{doc['kind']}/{doc['metadata']['name']}: " + "; ".join(
            f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_validators_reject_what_a_cluster_would_reject():
    """Both checks can fail: an unknown field in a Deployment, a misspelled and a missing
    field in a ScaledObject, a bad enum in an InferencePool."""
    docs = render("inference-extension")
    deployment = copy.deepcopy(next(d for d in docs if d["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}
    assert _kubernetes_validate(yaml.safe_dump(deployment)).returncode != 0

    scaled = next(d for d in docs if d["kind"] == "ScaledObject")
    misspelled = copy.deepcopy(scaled)
    misspelled["spec"]["maxReplicas"] = misspelled["spec"].pop("maxReplicaCount")
    missing = copy.deepcopy(scaled)
    del missing["spec"]["triggers"][0]["type"]
    pool = copy.deepcopy(next(d for d in docs if d["kind"] == "InferencePool"))
    pool["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    for bad in (misspelled, missing, pool):
        assert not _validator(bad["apiVersion"], bad["kind"]).is_valid(bad)
