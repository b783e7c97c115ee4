"""deploy/kubernetes/, checked without a cluster: every document against the Kubernetes
schemas (kubernetes-validate, strict: an unknown field is an error), then wired together
(labels and selectors, the Service's ports, the ConfigMap's keys, the volume) and held to
what the image runs (the options in their programs' --help). scripts/containers plays
the same files under `podman kube play` with a real run.
"""

from __future__ import annotations

import copy
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
KUBE = REPO / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"  # the oldest release still in upstream support when written
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())


def _docs() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(KUBE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            key = f"{doc['kind']}/{doc['metadata']['name']}"
            assert key not in out, f"{path.name}: {key} twice"
            out[key] = doc
    return out


DOCS = _docs()
CONFIG = DOCS["ConfigMap/calculet-load"]["data"]


def _pod(key: str) -> dict[str, Any]:
    spec: dict[str, Any] = DOCS[key]["spec"]["template"]["spec"]
    return spec


def _container(key: str) -> dict[str, Any]:
    (c,) = _pod(key)["containers"]
    return c


def _env(key: str) -> dict[str, str]:
    """A container's environment, its ConfigMap references resolved from config.yaml."""
    out = {}
    for e in _container(key).get("env", []):
        ref = e.get("valueFrom", {}).get("configMapKeyRef")
        if ref:
            assert ref["name"] == "calculet-load", e
            assert ref["key"] in CONFIG, f"{key}: {ref['key']} not in config.yaml"
            out[e["name"]] = CONFIG[ref["key"]]
        else:
            out[e["name"]] = e["value"]
    return out


def test_every_document_is_valid_against_the_kubernetes_schemas() -> None:
    assert set(DOCS) == {
        "ConfigMap/calculet-load", "PersistentVolumeClaim/calculet-runs",
        "Service/calculet-sim", "Deployment/calculet-sim", "Service/calculet-master",
        "Deployment/calculet-master", "Deployment/calculet-worker", "Job/calculet-run",
    }  # fmt: skip
    for key, doc in DOCS.items():
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "calculet-load", key


def test_the_validator_refuses_what_a_cluster_would() -> None:
    """The check above can fail: a misspelt field, a port as text, a pod without containers."""
    bad = copy.deepcopy(DOCS["Deployment/calculet-worker"])
    bad["spec"]["template"]["spec"]["containers"][0]["comand"] = ["locust"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = copy.deepcopy(DOCS["Service/calculet-master"])
    bad["spec"]["ports"][0]["port"] = "5557"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = copy.deepcopy(DOCS["Job/calculet-run"])
    del bad["spec"]["template"]["spec"]["containers"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_selectors_services_and_the_volume_fit_together() -> None:
    for key, doc in DOCS.items():
        if doc["kind"] == "Deployment":
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items(), key
    master = DOCS["Service/calculet-master"]["spec"]
    ports = {p["name"]: p["port"] for p in master["ports"]}
    assert ports == {"workers": 5557, "web": 8089, "metrics": 8090}
    # the Service reaches whichever runs the master: the web UI's Deployment or the Job
    for key in ("Deployment/calculet-master", "Job/calculet-run"):
        labels = DOCS[key]["spec"]["template"]["metadata"]["labels"]
        assert master["selector"].items() <= labels.items(), key
    workers = DOCS["Deployment/calculet-worker"]["spec"]["template"]["metadata"]["labels"]
    assert not master["selector"].items() <= workers.items()
    sim = DOCS["Service/calculet-sim"]["spec"]
    sim_labels = DOCS["Deployment/calculet-sim"]["spec"]["template"]["metadata"]["labels"]
    assert sim["selector"].items() <= sim_labels.items()
    assert CONFIG["target-url"] == f"http://calculet-sim:{sim['ports'][0]['port']}"
    assert CONFIG["master-host"] == "calculet-master"
    # one run folder: every pod that writes it mounts the claim at the image's runs/
    claim = DOCS["PersistentVolumeClaim/calculet-runs"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # pods on several nodes
    for key in ("Deployment/calculet-master", "Deployment/calculet-worker", "Job/calculet-run"):
        (volume,) = _pod(key)["volumes"]
        assert volume["persistentVolumeClaim"]["claimName"] == "calculet-runs", key
        (mount,) = _container(key)["volumeMounts"]
        assert (mount["name"], mount["mountPath"]) == (volume["name"], "/app/runs"), key


def test_the_workers_and_the_run_agree() -> None:
    worker = DOCS["Deployment/calculet-worker"]
    assert CONFIG["workers"] == str(worker["spec"]["replicas"])
    assert _container("Deployment/calculet-worker")["command"] == [
        "locust", "-f", "locustfiles/calculet.py", "--worker",
    ]  # fmt: skip
    assert _env("Deployment/calculet-worker") == {"LOCUST_MASTER_NODE_HOST": "calculet-master"}
    # a worker process times one core's requests: whole cores, and no CPU limit to
    # throttle it mid-stream
    resources = _container("Deployment/calculet-worker")["resources"]
    assert resources["requests"]["cpu"] == "1" and "cpu" not in resources.get("limits", {})
    job = DOCS["Job/calculet-run"]["spec"]
    assert job["template"]["spec"]["restartPolicy"] == "Never" and job["backoffLimit"] == 0
    env = _env("Job/calculet-run")
    assert env["LOCUST_EXPECT_WORKERS"] == CONFIG["workers"]
    assert env["LOCUST_HOST"] == CONFIG["target-url"]
    assert env["CALCULET_RUN_ROOT"] == "runs"  # the volume, under the image's /app
    script = _container("Job/calculet-run")["command"][2]
    assert _container("Job/calculet-run")["command"][:2] == ["sh", "-c"]
    # the run, then its analysis; the Job's exit code is the analysis' (or the run's)
    assert re.search(r"locust -f locustfiles/calculet\.py --master --headless", script)
    assert 'calculet-load analyze "$run" || exit $?' in script
    assert script.index("locust ") < script.index("calculet-load analyze")


def test_every_image_is_the_one_compose_builds() -> None:
    image = COMPOSE["x-calculet"]["image"]
    for key, doc in DOCS.items():
        if "template" in doc.get("spec", {}):
            c = _container(key)
            assert c["image"] == image and c["imagePullPolicy"] == "IfNotPresent", key


_LOCUST_HELP = (
    "import runpy, sys; runpy.run_path(sys.argv[1]); "
    "from locust.argument_parser import get_parser; get_parser().print_help()"
)


def _help(program: str) -> str:
    if program == "locust":  # with the locustfile loaded: calculet's options too
        cmd = [sys.executable, "-c", _LOCUST_HELP, "locustfiles/calculet.py"]
    else:
        cmd = [str(BIN / program), "--help"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _has(help_text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


def test_every_option_appears_in_its_programs_help() -> None:
    locust = _help("locust")
    for key in ("Deployment/calculet-sim", "Deployment/calculet-master",
                "Deployment/calculet-worker"):  # fmt: skip
        cmd = _container(key)["command"]
        text = locust if cmd[0] == "locust" else _help(cmd[0])
        for flag in (t for t in cmd[1:] if t.startswith("-")):
            assert _has(text, flag), (key, flag)
    script = _container("Job/calculet-run")["command"][2]
    for flag in re.findall(r"(?<=\s)--?[a-z][\w-]*", script.split("calculet-load analyze")[0]):
        assert _has(locust, flag), ("Job", flag)
    for flag in CONFIG["run-args"].split()[::2]:
        assert _has(locust, flag), ("run-args", flag)
    # Locust's own environment variables, as its parser names them
    env_vars = subprocess.run(
        [sys.executable, "-c", _LOCUST_ENV_VARS], cwd=REPO, capture_output=True, text=True,
        timeout=60,
    ).stdout.split()  # fmt: skip
    for var in {*_env("Job/calculet-run"), *_env("Deployment/calculet-worker")}:
        if var.startswith("LOCUST_"):
            assert var in env_vars, var


_LOCUST_ENV_VARS = (
    "from locust.argument_parser import get_parser; "
    "print(*(a.env_var for a in get_parser()._actions if getattr(a, 'env_var', None)))"
)


def _containers_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("containers", REPO / "scripts/containers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_job_plays_under_podman_as_the_pod_a_cluster_makes() -> None:
    """scripts/containers plays the Job's pod (podman 4 plays no Jobs): the template's
    spec and labels, unchanged, under the Job's name."""
    script = _containers_script()
    docs = script.kube_docs()
    assert docs.keys() == DOCS.keys()
    pod = script.job_as_pod(DOCS["Job/calculet-run"])
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    template = DOCS["Job/calculet-run"]["spec"]["template"]
    assert pod["kind"] == "Pod" and pod["metadata"]["name"] == "calculet-run"
    assert pod["spec"] == template["spec"]
    assert pod["metadata"]["labels"] == template["metadata"]["labels"]
    # what the script reads back is what the compose files write
    assert COMPOSE["x-calculet"]["image"] == script.IMAGE
    accept = COMPOSE["services"]["accept"]["command"]
    assert f"runs/{script.ACCEPT_RUN}" == accept[accept.index("--run-dir") + 1]
    headless = yaml.safe_load((REPO / "deploy/containers/compose.headless.yml").read_text())
    master = headless["services"]["master"]["command"]
    assert f"runs/{script.HEADLESS_RUN}" == master[master.index("--run-dir") + 1]
