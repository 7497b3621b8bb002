"""The Kubernetes manifest and the Serve config file: well-formed for KubeRay's RayService, and their application's
arguments taken by fastdecode.cluster:app (the builder runs; nothing is deployed)."""
from pathlib import Path

import jsonschema
import pytest
import yaml

pytest.importorskip("ray", reason="the cluster extra: pip install 'fastdecode[cluster]'")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CONTAINERS = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["name", "image"],
    "properties": {"name": {"type": "string"}, "image": {"type": "string"},
                   "resources": {"type": "object", "properties": {
                       "requests": {"type": "object"}, "limits": {"type": "object"}}}}}}
POD = {"type": "object", "required": ["spec"], "properties": {"spec": {
    "type": "object", "required": ["containers"], "properties": {"containers": CONTAINERS}}}}
# The part of KubeRay's RayService CRD (ray.io/v1) the manifest uses, as the CRD spells it.
RAYSERVICE = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"}, "kind": {"const": "RayService"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["serveConfigV2", "rayClusterConfig"], "additionalProperties": False,
                 "properties": {
                     "serveConfigV2": {"type": "string"},
                     "rayClusterConfig": {
                         "type": "object", "required": ["headGroupSpec"], "additionalProperties": False,
                         "properties": {
                             "rayVersion": {"type": "string"},
                             "headGroupSpec": {"type": "object", "required": ["template"],
                                               "properties": {"rayStartParams": {"type": "object"},
                                                              "template": POD}},
                             "workerGroupSpecs": {"type": "array", "items": {
                                 "type": "object", "required": ["groupName", "template"],
                                 "properties": {"groupName": {"type": "string"}, "replicas": {"type": "integer"},
                                                "minReplicas": {"type": "integer"},
                                                "maxReplicas": {"type": "integer"},
                                                "rayStartParams": {"type": "object"}, "template": POD}}}}}}}}}


def application_args(serve_config: dict) -> dict:
    (application,) = serve_config["applications"]
    assert application["import_path"] == "fastdecode.cluster:app"
    return application["args"]


def test_the_rayservice_manifest_is_a_valid_rayservice_whose_app_builds():
    from fastdecode.cluster import app

    manifest = yaml.safe_load((DEPLOY / "kubernetes" / "rayservice.yaml").read_text())
    jsonschema.validate(manifest, RAYSERVICE)
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    args = application_args(serve_config)
    assert app(args) is not None  # the builder takes every argument the manifest gives it
    workers = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    cpus = int(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
    assert cpus >= args["threads"]  # a worker pod holds at least one replica


def test_the_serve_config_builds_and_the_builder_refuses_unknown_arguments():
    from fastdecode.cluster import app

    args = application_args(yaml.safe_load((DEPLOY / "serve_config.yaml").read_text()))
    assert app(args) is not None
    with pytest.raises(ValueError, match="replcas"):
        app({**args, "replcas": 3})
