"""The Kubernetes manifests under docker/k8s/ validate against Kubernetes' own schemas (kubernetes-validate, offline,
strict: an unknown field fails), and carry what a fleet needs: GPU requests, health-based readiness, a draining
preStop, self-registration, an autoscaled gateway, worker and beat, external Postgres and Redis."""

import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import REPO

K8S = REPO / "docker" / "k8s"


def manifests() -> dict[tuple[str, str], dict]:
    found = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


def test_manifests_validate_strictly(tmp_path):
    validate = Path(sys.executable).parent / "kubernetes-validate"
    files = [str(p) for p in sorted(K8S.glob("*.yaml"))]
    result = subprocess.run([str(validate), "--strict", "--quiet", *files], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    bad = tmp_path / "bad.yaml"  # and a broken one fails: the check is not a no-op
    bad.write_text("apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: x\nspec:\n  replicass: 2\n")
    assert subprocess.run([str(validate), "--strict", "--quiet", str(bad)], capture_output=True).returncode != 0


def test_the_fleet_pieces_are_there():
    found = manifests()
    assert {("Deployment", n) for n in ("quilt-gateway", "quilt-engine", "quilt-worker", "quilt-beat")} <= found.keys()
    assert ("HorizontalPodAutoscaler", "quilt-gateway") in found and ("Service", "quilt-gateway") in found
    engine = found[("Deployment", "quilt-engine")]["spec"]["template"]["spec"]["containers"][0]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "/v1/health" in " ".join(engine["readinessProbe"]["exec"]["command"])
    assert "kill -TERM 1" in " ".join(engine["lifecycle"]["preStop"]["exec"]["command"])
    env = {e["name"]: e for e in engine["env"]}
    assert {"QUILT_CONTROL_PLANE_URL", "QUILT_ENGINE_TOKEN", "QUILT_ADVERTISE_URL", "QUILT_ENGINE_NAME"} <= env.keys()
    config = found[("ConfigMap", "quilt-config")]["data"]
    assert config["QUILT_CONTROL_PLANE_URL"] == "http://quilt-gateway:8000"
    assert "quilt-gateway" in config["ALLOWED_HOSTS"].split(",")
    assert not any(kind == "StatefulSet" for kind, _ in found)  # Postgres and Redis are external, by URL
    assert found[("Deployment", "quilt-beat")]["spec"]["replicas"] == 1


def test_compose_scales_engines_without_a_host_port():
    compose = yaml.safe_load((REPO / "docker" / "compose.engine.yaml").read_text())["services"]["engine"]
    assert "ports" not in compose  # --scale engine=N: no host port to clash
    assert compose["environment"]["QUILT_CONTROL_PLANE_URL"] == "http://gateway:8000"
    assert "--usage-spool" not in compose["command"]  # one spool file per engine, named by the engine
    main = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())["services"]
    assert "register-engine" not in main and "gateway" in main["gateway"]["environment"]["ALLOWED_HOSTS"]


def test_no_pod_shares_a_volume_for_adapters():
    """Adapter blobs live in S3: the gateway and the worker write them there, and each engine downloads what it serves
    into its own disk cache (an emptyDir bounded above the engine's byte bound). No ReadWriteMany claim is needed."""
    found = manifests()
    assert not [name for (kind, name), doc in found.items() if kind == "PersistentVolumeClaim"
                and "ReadWriteMany" in doc["spec"]["accessModes"]]  # fmt: skip
    assert found[("ConfigMap", "quilt-config")]["data"]["AWS_STORAGE_BUCKET_NAME"]
    for name in ("quilt-gateway", "quilt-worker", "quilt-engine"):
        pod = found[("Deployment", name)]["spec"]["template"]["spec"]
        claims = {v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
        assert claims <= {"quilt-models"}, (name, claims)
    pod = found[("Deployment", "quilt-engine")]["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert "--adapter-store" not in args
    cache_dir = args[args.index("--adapter-disk-cache") + 1]
    cache_bytes = int(args[args.index("--adapter-disk-cache-bytes") + 1])
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == cache_dir)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    size_limit = volume["emptyDir"]["sizeLimit"]
    assert size_limit.endswith("Gi") and int(size_limit[:-2]) * 1024**3 > cache_bytes


def test_compose_engines_download_adapters_when_storage_is_remote():
    compose = yaml.safe_load((REPO / "docker" / "compose.engine.yaml").read_text())["services"]["engine"]
    cache_dir = compose["command"][compose["command"].index("--adapter-disk-cache") + 1]
    assert any(volume.endswith(f":{cache_dir}") for volume in compose["volumes"])
    platform = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())["services"]["gateway"]["environment"]
    assert "AWS_STORAGE_BUCKET_NAME" in platform
