"""The Kubernetes and KServe manifests in deploy/ checked offline, with no cluster and no Docker.

* Every Kubernetes object is validated, strictly (unknown fields are errors), against the Kubernetes
  OpenAPI JSON schemas that `kubernetes-validate` ships: the oldest version the manifests support
  (1.27: native gRPC probes are GA there) and the newest the package knows.
* The KServe InferenceService is a custom resource, and no registry package ships its CRD schema (the
  `kserve` SDK on PyPI has generated Python models, not the CRD's OpenAPI). So its predictor
  containers are validated against the core/v1 Container schema (that is what KServe embeds), and its
  fields are cross-checked with the files they must agree with: the image names docker-compose builds,
  the ports and ENV the Dockerfile's targets set, and the server's own argument and environment parser
  (`serve.config.load_config`), which must accept every container's args and ENCODER_* variables.
  The Deployment and the export Job are cross-checked the same way.
* Every serving manifest (compose, the Deployment, KServe) serves a model repository, and the export
  jobs (compose, the Job) fill one: which models they write is read by running the export image's
  entrypoint (docker/export_repository.sh) with a stand-in `python` that records its arguments, parsed
  by the exporter's own parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the dev extra brings kubernetes-validate")

from serve.config import ENV_PREFIX, ServerConfig, load_config  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
NON_CORE_API_GROUPS = ("kustomize.config.k8s.io/", "serving.kserve.io/")  # no schema in kubernetes-validate


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kubernetes_objects() -> list[tuple[str, dict]]:
    objects = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in _documents(path):
            if not doc["apiVersion"].startswith(NON_CORE_API_GROUPS):
                objects.append((f"{path.relative_to(REPO)}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return objects


def _by_kind(kind: str, path: Path) -> list[dict]:
    return [doc for doc in _documents(path) if doc["kind"] == kind]


def _dockerfile_stage(name: str) -> dict[str, set[str] | dict[str, str]]:
    """EXPOSE ports and ENV of one stage of docker/Dockerfile, as written there."""
    text = (REPO / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    stages = re.split(r"^FROM ", text, flags=re.M)
    body = next(s for s in stages if re.match(rf"\S+ AS {name}\s*$", s.splitlines()[0]))
    expose, env = set(), {}
    for line in body.splitlines():
        if line.startswith("EXPOSE "):
            expose |= set(line.split()[1:])
        elif line.startswith("ENV "):
            env.update(dict(pair.split("=", 1) for pair in line.split()[1:]))
    return {"expose": expose, "env": env}


COMPOSE_DEFAULT = re.compile(r"\$\{[A-Z_]+:?-([^}]*)\}")  # ${VAR:-default} -> default


def _compose_services() -> dict[str, dict]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]


def _compose_images() -> dict[str, str]:
    """Service -> image as docker-compose names it, default values of ${VAR:-default} filled in."""
    return {name: COMPOSE_DEFAULT.sub(r"\1", spec["image"]) for name, spec in _compose_services().items()}


def _export_entrypoint() -> list[str]:
    """The export image's ENTRYPOINT, with the script it runs mapped back to its file in this checkout."""
    text = (REPO / "docker" / "export.Dockerfile").read_text()
    (entrypoint,) = re.findall(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    copies = dict(reversed(line.split()[1:3]) for line in text.splitlines() if line.startswith("COPY docker/"))
    return [str(REPO / copies[word]) if word in copies else word for word in json.loads(entrypoint)]


def _export_image_runs(tmp_path: Path, args: Sequence[str] = (), env: dict | None = None) -> list[list[str]]:
    """The `python` command lines the export image's ENTRYPOINT runs with `args` and environment `env`, in order
    (a stand-in `python` records them; nothing runs)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(f"#!{sys.executable}\nimport json, sys\n"
                                    f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    (bin_dir / "python").chmod(0o755)
    subprocess.run([*_export_entrypoint(), *args], env={**(env or {}), "PATH": f"{bin_dir}:/usr/bin:/bin"},
                   check=True, timeout=30)
    return [json.loads(line) for line in calls.read_text().splitlines()]


def _exports_written(tmp_path: Path, args: Sequence[str] = ()) -> list[argparse.Namespace]:
    """What the export image does with `args` after its ENTRYPOINT: the exporter's parsed arguments of
    each `python -m export` it runs, in order."""
    from export.cli import build_parser as export_parser

    runs = _export_image_runs(tmp_path, args)
    assert all(run[:2] == ["-m", "export"] for run in runs), runs
    return [export_parser().parse_args(run[2:]) for run in runs]


def _export_name(args: argparse.Namespace) -> str:
    """The folder an export run writes under --out-dir: --name, else its config's own name."""
    from model.config import EncoderConfig
    from model.hf_pretrained import MINILM_NAME

    return args.name or (MINILM_NAME if args.minilm else EncoderConfig().name)


def _repository_and_tag(image: str) -> tuple[str, str]:
    name, _, tag = image.rpartition(":")
    return name.rsplit("/", 1)[-1], tag


def _check_serving_container(container: dict, stage: str) -> None:
    """A serving container agrees with the image target it runs and with the server's parser."""
    built = _dockerfile_stage(stage)
    env = {item["name"]: item["value"] for item in container.get("env", [])}
    unknown = {name for name in env if name.startswith(ENV_PREFIX)} - \
        {ENV_PREFIX + field.name.upper() for field in dataclasses.fields(ServerConfig)}
    assert not unknown, f"{container['name']}: no such server setting {sorted(unknown)}"
    # The server's own parser takes the args with the image's ENV overlaid by the manifest's env.
    config = load_config(container.get("args", []), environ={**built["env"], **env})
    assert config.device == built["env"]["ENCODER_DEVICE"], "args pick another device than the image's target"

    ports = {port["containerPort"] for port in container["ports"]}
    assert config.port in ports and str(config.port) in built["expose"], (ports, config.port, built["expose"])
    for port in ports:
        assert str(port) in built["expose"], f"containerPort {port} is not EXPOSEd by the {stage} target"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe in container:
            assert container[probe]["grpc"]["port"] == config.port, f"{probe} checks another port"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name,obj", _kubernetes_objects(), ids=lambda value: value if isinstance(value, str) else "")
def test_every_kubernetes_manifest_validates_strictly_against_the_schema(name, obj, version):
    kubernetes_validate.validate(obj, version, strict=True)


def test_strict_validation_rejects_a_misspelt_field():
    """The check has teeth: a typo in a probe is an error, not an ignored key."""
    deployment = _by_kind("Deployment", DEPLOY / "k8s" / "deployment.yaml")[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grcp"] = {"port": 50051}
    with pytest.raises(kubernetes_validate.ValidationError, match="grcp"):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest_in_its_folder():
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {path.name for path in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


def _pod_images(pod: dict) -> list[str]:
    return [c["image"] for c in (*pod.get("initContainers", ()), *pod["containers"])]


def _k8s_images() -> set[str]:
    """Every image a Kubernetes manifest in deploy/k8s runs (containers and init containers)."""
    return {image for path in (DEPLOY / "k8s").glob("*.yaml") for doc in _documents(path)
            if "template" in doc.get("spec", {}) for image in _pod_images(doc["spec"]["template"]["spec"])}


def test_kustomization_names_every_image_it_deploys_so_the_registry_can_be_changed_in_one_place():
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    entries = {entry["name"]: entry for entry in kustomization["images"]}
    for image in _k8s_images():
        name, _, tag = image.rpartition(":")
        assert name in entries, f"{image}: no `images:` entry in kustomization.yaml"
        assert entries[name]["newTag"] == tag, f"{image}: kustomization.yaml sets another tag"
    assert {entry["name"] for entry in entries.values()} == {image.rpartition(":")[0] for image in _k8s_images()}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) not installed")
def test_kustomize_renders_every_container_from_the_images_entries(tmp_path):
    """What `kubectl apply -k` applies after a user pointed the `images:` entries at their registry."""
    base = tmp_path / "k8s"
    shutil.copytree(DEPLOY / "k8s", base)
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    for entry in kustomization["images"]:
        entry["newName"] = "my.registry.test/team/" + entry["name"].rsplit("/", 1)[-1]
        entry["newTag"] = "v1"
    (base / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    rendered = subprocess.run(["kubectl", "kustomize", str(base)], capture_output=True, text=True, timeout=60,
                              check=True).stdout
    images = {image for doc in yaml.safe_load_all(rendered) if doc and "template" in doc.get("spec", {})
              for image in _pod_images(doc["spec"]["template"]["spec"])}
    assert images == {"my.registry.test/team/onnx-encoder-serve:v1", "my.registry.test/team/onnx-encoder-export:v1"}


def test_export_image_without_arguments_writes_the_repository_and_with_arguments_one_export(tmp_path):
    repository = _exports_written(tmp_path / "repository")
    assert [(str(args.out_dir), _export_name(args)) for args in repository] == \
        [("/exports", "default"), ("/exports", "all-minilm-l6-v2")]
    assert [args.minilm for args in repository] == [False, True]
    # arguments make it one plain `python -m export` (compose: `run --rm export --out-dir /exports ...`)
    (one,) = _exports_written(tmp_path / "one", ["--out-dir", "/exports", "--variant", "pre-norm"])
    assert (str(one.out_dir), one.variant) == ("/exports", ["pre-norm"])


def test_deployment_waits_for_every_model_of_the_export_job_in_an_init_container(tmp_path):
    deployment = _by_kind("Deployment", DEPLOY / "k8s" / "deployment.yaml")[0]
    pod = deployment["spec"]["template"]["spec"]
    (wait,), (serve,) = pod["initContainers"], pod["containers"]
    assert wait["image"] == serve["image"]  # nothing else to pull
    assert wait["volumeMounts"] == [m for m in serve["volumeMounts"] if m["name"] == "exports"]
    env = {item["name"]: item["value"] for item in wait["env"]}
    config = load_config([], environ={item["name"]: item["value"] for item in serve["env"]})
    mount = next(m["mountPath"] for m in serve["volumeMounts"] if m["name"] == "exports")
    assert env["ENCODER_MODEL_REPOSITORY"] == config.model_repository == mount
    # it waits for exactly the models the export Job writes there (the image's entrypoint, no arguments)
    (job,) = _by_kind("Job", DEPLOY / "k8s" / "export-job.yaml")
    (exporter,) = job["spec"]["template"]["spec"]["containers"]
    written = _exports_written(tmp_path / "job", exporter.get("args", []))
    assert {str(args.out_dir) for args in written} == {mount}
    assert env["MODELS"].split() == [_export_name(args) for args in written]
    assert config.default_model in env["MODELS"].split()

    # The command itself, run by sh here on a stand-in repository: it waits while any model's
    # metadata.json is missing (says so, and keeps running) and ends at once when all are there.
    stand_in = tmp_path / "repository"
    command, local = wait["command"], {**env, "ENCODER_MODEL_REPOSITORY": str(stand_in), "PATH": "/usr/bin:/bin"}
    for model in env["MODELS"].split():
        waiting = subprocess.Popen(command, env=local, stdout=subprocess.PIPE, text=True)
        try:
            line = waiting.stdout.readline()
            assert f"{stand_in}/{model}/metadata.json" in line and waiting.poll() is None, line
        finally:
            waiting.kill()
            waiting.wait(10)
        (stand_in / model).mkdir(parents=True)
        (stand_in / model / "metadata.json").write_text("{}")
    subprocess.run(command, env=local, timeout=30, check=True)


def test_deployment_runs_the_gpu_image_with_ports_probes_and_args_the_server_accepts():
    deployment = _by_kind("Deployment", DEPLOY / "k8s" / "deployment.yaml")[0]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert _repository_and_tag(container["image"]) == _repository_and_tag(_compose_images()["serve"])
    _check_serving_container(container, "gpu")
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's user (docker/Dockerfile)
    config = load_config([], environ={item["name"]: item["value"] for item in container["env"]})
    assert config.drain_delay_s > 0, "a terminating pod would refuse calls before its endpoints are gone"
    assert pod["terminationGracePeriodSeconds"] > config.drain_delay_s + config.grace_s, \
        "Kubernetes would kill the pod mid-drain"
    metrics = next(port["containerPort"] for port in container["ports"] if port["name"] == "metrics")
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(metrics)


def test_services_target_named_ports_of_the_deployment():
    deployment = _by_kind("Deployment", DEPLOY / "k8s" / "deployment.yaml")[0]
    container_ports = {port["name"] for port in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for service in _by_kind("Service", DEPLOY / "k8s" / "service.yaml"):
        assert service["spec"]["selector"].items() <= labels.items()
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in container_ports


def test_export_job_runs_the_export_image_into_the_claim_the_deployment_mounts(tmp_path):
    path = DEPLOY / "k8s" / "export-job.yaml"
    (job,), (claim,) = _by_kind("Job", path), _by_kind("PersistentVolumeClaim", path)
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert _repository_and_tag(container["image"]) == _repository_and_tag(_compose_images()["export"])
    mount = next(m for m in container["volumeMounts"] if m["name"] == "exports")
    written = _exports_written(tmp_path, container.get("args", []))
    assert len(written) > 1 and {str(args.out_dir) for args in written} == {mount["mountPath"]}
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    deployment = _by_kind("Deployment", DEPLOY / "k8s" / "deployment.yaml")[0]
    serving_claims = {v["persistentVolumeClaim"]["claimName"] for v in deployment["spec"]["template"]["spec"]["volumes"]
                      if "persistentVolumeClaim" in v}
    assert serving_claims == {claim["metadata"]["name"]}


def test_compose_serves_the_repository_the_export_job_writes(tmp_path):
    services = _compose_services()
    export = services["export"]
    # neither command nor entrypoint: the image's entrypoint without arguments, which writes the repository
    assert "command" not in export and "entrypoint" not in export
    (export_mount,) = [v.split(":")[1] for v in export["volumes"] if v.split(":")[0] == "exports"]
    written = _exports_written(tmp_path)
    assert {str(args.out_dir) for args in written} == {export_mount}
    for name in ("serve", "serve-cpu"):
        spec = services[name]
        env = {key: COMPOSE_DEFAULT.sub(r"\1", str(value)) for key, value in spec["environment"].items()}
        unknown = {key for key in env if key.startswith(ENV_PREFIX)} - \
            {ENV_PREFIX + field.name.upper() for field in dataclasses.fields(ServerConfig)}
        assert not unknown, f"{name}: no such server setting {sorted(unknown)}"
        config = load_config(spec.get("command", []), environ=env)
        (mount,) = [COMPOSE_DEFAULT.sub(r"\1", v).split(":") for v in spec["volumes"] if ":/exports" in v]
        assert mount == ["exports", "/exports", "ro"]  # the export job's volume, read-only
        assert config.model_repository == export_mount
        assert config.default_model in {_export_name(args) for args in written}


def test_hpa_scales_the_deployment():
    (hpa,) = _by_kind("HorizontalPodAutoscaler", DEPLOY / "k8s" / "hpa.yaml")
    deployment = _by_kind("Deployment", DEPLOY / "k8s" / "deployment.yaml")[0]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] <= deployment["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]


def _inference_services() -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc
            for doc in _by_kind("InferenceService", DEPLOY / "kserve" / "inferenceservice.yaml")}


def test_kserve_custom_predictor_container_validates_against_the_core_container_schema():
    for name, service in _inference_services().items():
        assert service["apiVersion"] == "serving.kserve.io/v1beta1"
        for container in service["spec"]["predictor"].get("containers", []):
            # kubernetes-validate resolves a schema by kind; a bare Container has none, so wrap it in
            # the smallest Pod, whose strict schema embeds the core/v1 Container that KServe embeds.
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                   "spec": {"containers": [container]}}
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(pod, version, strict=True)


def test_kserve_custom_predictor_agrees_with_the_image_and_the_server():
    predictor = _inference_services()["encoder"]["spec"]["predictor"]
    (container,) = predictor["containers"]
    assert container["name"] == "kserve-container"  # the name KServe gives the model server container
    assert _repository_and_tag(container["image"]) == _repository_and_tag(_compose_images()["serve"])
    _check_serving_container(container, "gpu")
    # KServe routes gRPC to a port named h2c; it must be the server's gRPC port.
    (port,) = container["ports"]
    assert port["name"] == "h2c"
    env = {item["name"]: item["value"] for item in container["env"]}
    # a model repository, where KServe's storage initializer writes STORAGE_URI
    assert load_config([], environ=env).model_repository == "/mnt/models"
    assert predictor["minReplicas"] <= predictor["maxReplicas"]


def test_kserve_scrapes_the_server_metrics_through_the_queue_proxy():
    """enable-prometheus-scraping alone reads the queue-proxy; with metric aggregation it also fetches
    the server's own metrics, from the port and path the prometheus.kserve.io annotations give."""
    service = _inference_services()["encoder"]
    annotations = service["metadata"]["annotations"]
    assert annotations["serving.kserve.io/enable-prometheus-scraping"] == "true"
    assert annotations["serving.kserve.io/enable-metric-aggregation"] == "true"
    (container,) = service["spec"]["predictor"]["containers"]
    env = {**_dockerfile_stage("gpu")["env"], **{item["name"]: item["value"] for item in container["env"]}}
    config = load_config(container.get("args", []), environ=env)
    assert annotations["prometheus.kserve.io/port"] == str(config.metrics_port)
    assert annotations["prometheus.kserve.io/path"] == "/metrics"  # prometheus_client's start_http_server


def test_kserve_triton_predictor_uses_the_v2_protocol_on_an_onnx_model():
    model = _inference_services()["encoder-triton"]["spec"]["predictor"]["model"]
    assert model["modelFormat"]["name"] == "onnx" and model["protocolVersion"] == "v2"
    assert [port["name"] for port in model["ports"]] == ["h2c"]


# -- models by id: deploy/k8s-by-id (a kustomize overlay of deploy/k8s) and KServe's encoder-by-id ----------------

def _export_image_env() -> dict[str, str]:
    """The ENV of docker/export.Dockerfile, as written there."""
    text = (REPO / "docker" / "export.Dockerfile").read_text().replace("\\\n", " ")
    return dict(pair.split("=", 1) for line in text.splitlines() if line.startswith("ENV ") for pair in line.split()[1:])


def _container_env(container: dict, config_maps: dict[str, dict]) -> dict[str, str]:
    """A container's environment: its envFrom ConfigMaps, then its env values (a Secret's value: left out)."""
    env = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]])
    env.update({item["name"]: item["value"] for item in container.get("env", []) if "value" in item})
    return env


def _check_models_by_id(init: dict, serve: dict, volumes: list[dict], config_maps: dict[str, dict],
                        tmp_path: Path) -> None:
    """The init container (the export image) warms the cache with exactly the models the server serves, on the volume
    the server mounts at the same place, read-write; the server takes them by id and has no repository."""
    assert _repository_and_tag(init["image"]) == _repository_and_tag(_compose_images()["export"])
    init_env = _container_env(init, config_maps)
    (run,) = _export_image_runs(tmp_path, init.get("args", []), init_env)  # the image's own entrypoint, as deployed
    assert run[:2] == ["-m", "serve"]
    warm = load_config(run[2:], environ={**_export_image_env(), **init_env})
    assert warm.prepare_only and warm.model
    serve_env = _container_env(serve, config_maps)
    _check_serving_container({**serve, "env": [{"name": k, "value": v} for k, v in serve_env.items()]}, "gpu")
    served = load_config(serve.get("args", []), environ={**_dockerfile_stage("gpu")["env"], **serve_env})
    assert (served.model, served.models_file, served.export_graphs) == (warm.model, warm.models_file, warm.export_graphs)
    assert served.export_cache == warm.export_cache and served.model_repository == ""
    assert _dockerfile_stage("gpu")["env"]["HF_HOME"] == _export_image_env()["HF_HOME"]  # one Hugging Face cache
    from serve.assembly.model_ids import specs_of

    assert served.default_model in {spec.name for spec in specs_of(served)}
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v}
    for container in (init, serve):
        (mount,) = [m for m in container["volumeMounts"] if served.export_cache.startswith(m["mountPath"] + "/")]
        assert _export_image_env()["HF_HOME"].startswith(mount["mountPath"] + "/")
        assert not mount.get("readOnly") and mount["name"] in claims
    assert len({m["name"] for c in (init, serve) for m in c["volumeMounts"] if m["name"] in claims}) == 1


def test_the_export_image_with_model_ids_warms_the_export_cache(tmp_path):
    (run,) = _export_image_runs(tmp_path, env={"ENCODER_MODEL": "bge=BAAI/bge-base-en-v1.5"})
    assert run[:2] == ["-m", "serve"]
    config = load_config(run[2:], environ={**_export_image_env(), "ENCODER_MODEL": "bge=BAAI/bge-base-en-v1.5"})
    assert config.prepare_only and config.export_cache == _export_image_env()["ENCODER_EXPORT_CACHE"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) not installed")
def test_the_by_id_overlay_warms_the_cache_in_an_init_container_and_serves_the_ids(tmp_path):
    rendered = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "k8s-by-id")], capture_output=True, text=True,
                              timeout=60, check=True).stdout
    docs = [doc for doc in yaml.safe_load_all(rendered) if doc]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
    kinds = {(doc["kind"], doc["metadata"]["name"]) for doc in docs}
    assert ("Job", "encoder-export") not in kinds and ("PersistentVolumeClaim", "encoder-exports") not in kinds
    config_maps = {doc["metadata"]["name"]: doc["data"] for doc in docs if doc["kind"] == "ConfigMap"}
    (deployment,) = [doc for doc in docs if doc["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (init,), (serve,) = pod["initContainers"], pod["containers"]
    _check_models_by_id(init, serve, pod["volumes"], config_maps, tmp_path)
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {doc["metadata"]["name"] for doc in docs if doc["kind"] == "PersistentVolumeClaim"}


def test_kserve_by_id_warms_the_cache_in_an_init_container_and_serves_the_ids(tmp_path):
    path = DEPLOY / "kserve" / "inferenceservice.yaml"
    config_maps = {doc["metadata"]["name"]: doc["data"] for doc in _by_kind("ConfigMap", path)}
    predictor = _inference_services()["encoder-by-id"]["spec"]["predictor"]
    (init,), (serve,) = predictor["initContainers"], predictor["containers"]
    assert serve["name"] == "kserve-container" and [port["name"] for port in serve["ports"]] == ["h2c"]
    _check_models_by_id(init, serve, predictor["volumes"], config_maps, tmp_path)
    (claim,) = _by_kind("PersistentVolumeClaim", DEPLOY / "k8s-by-id" / "cache-pvc.yaml")
    assert {v["persistentVolumeClaim"]["claimName"] for v in predictor["volumes"]} == {claim["metadata"]["name"]}
