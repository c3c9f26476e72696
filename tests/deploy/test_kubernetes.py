"""deploy/kubernetes/: every manifest is a valid Kubernetes object (the API's own schemas,
strict: no unknown field), every container's arguments parse with kvrelay's own command line,
and the pieces agree with each other: the router lists one URL per prefill and decode pod, the
probes hit declared ports on routes the servers have, the PD secret is a mounted file where the
arguments look for it, decode's transfer port is declared and only prefill pods may reach it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kvrelay.cli import build_parser

kv = pytest.importorskip("kubernetes_validate")

DIR = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"  # the oldest release still in wide use that the manifests target


def _docs() -> list[dict]:
    out = []
    for f in sorted(DIR.glob("*.yaml")):
        if f.name != "kustomization.yaml":
            out += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return out


DOCS = _docs()


def _one(kind: str, name: str) -> dict:
    (d,) = [d for d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return d


def _container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def _env_values(c: dict) -> dict[str, str]:
    """$(VAR) values a container's arguments may use: its ConfigMap and stand-ins for the rest."""
    vals = {}
    for src in c.get("envFrom", []):
        vals |= _one("ConfigMap", src["configMapRef"]["name"])["data"]
    for e in c.get("env", []):
        vals[e["name"]] = e.get("value", "10.0.0.7")  # fieldRef / secretKeyRef: a stand-in
    return vals


def _args(c: dict) -> list[str]:
    vals = _env_values(c)
    return [re.sub(r"\$\((\w+)\)", lambda m: vals[m[1]], a) for a in c["args"]]


def test_kustomization_lists_every_manifest():
    k = yaml.safe_load((DIR / "kustomization.yaml").read_text())
    files = {f.name for f in DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(k["resources"]) == files


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_object_validates_strictly_against_the_kubernetes_schema(doc):
    kv.validate(doc, K8S_VERSION, strict=True)


def test_container_arguments_parse_with_the_kvrelay_command_line():
    parser = build_parser()
    for name in ("kvrelay-prefill", "kvrelay-decode"):
        c = _container(_one("StatefulSet", name))
        a = parser.parse_args(_args(c))
        assert a.command == "serve" and a.role == name.rsplit("-", 1)[1]
        assert a.host == "0.0.0.0" and c["command"] == ["kvrelay"]
    a = parser.parse_args(_args(_container(_one("Deployment", "kvrelay-router"))))
    assert a.command == "router" and a.host == "0.0.0.0"


def test_the_router_lists_one_url_per_server_pod():
    a = build_parser().parse_args(_args(_container(_one("Deployment", "kvrelay-router"))))
    for role, urls in (("prefill", a.prefill), ("decode", a.decode)):
        sts = _one("StatefulSet", f"kvrelay-{role}")
        svc = _one("Service", sts["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None"  # headless: a DNS name per pod
        port = svc["spec"]["ports"][0]["port"]
        want = [
            f"http://{sts['metadata']['name']}-{i}.{svc['metadata']['name']}:{port}"
            for i in range(sts["spec"]["replicas"])
        ]
        assert urls.split(",") == want


def test_probes_use_declared_ports_and_real_routes():
    for kind, name in (
        ("StatefulSet", "kvrelay-prefill"),
        ("StatefulSet", "kvrelay-decode"),
        ("Deployment", "kvrelay-router"),
    ):
        c = _container(_one(kind, name))
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            if probe in c:
                assert c[probe]["httpGet"]["port"] in ports, (name, probe)
        assert f"--port={ports['http']}" in c["args"]
        # A Service's named targetPort must exist on the pods it selects.
        for svc in [d for d in DOCS if d["kind"] == "Service"]:
            labels = _one(kind, name)["spec"]["template"]["metadata"]["labels"]
            if svc["spec"]["selector"].items() <= labels.items():
                assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(ports)


def test_gpu_servers_request_a_gpu_and_shared_memory():
    for name in ("kvrelay-prefill", "kvrelay-decode"):
        sts = _one("StatefulSet", name)
        c = _container(sts)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        vols = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
        assert vols[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def test_secrets_come_from_the_secret_and_the_pd_secret_is_a_mounted_file():
    for kind, name in (
        ("StatefulSet", "kvrelay-prefill"),
        ("StatefulSet", "kvrelay-decode"),
        ("Deployment", "kvrelay-router"),
    ):
        w = _one(kind, name)
        c = _container(w)
        a = build_parser().parse_args(_args(c))
        assert a.pd_secret is None and a.pd_secret_file  # never on the command line
        (key,) = [e for e in c["env"] if e["name"] == "KVRELAY_API_KEY"]
        assert key["valueFrom"]["secretKeyRef"] == {"name": "kvrelay-secrets", "key": "api-key"}
        vols = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        (mount,) = [m for m in c["volumeMounts"] if a.pd_secret_file.startswith(m["mountPath"])]
        secret = vols[mount["name"]]["secret"]
        assert secret["secretName"] == "kvrelay-secrets" and mount["readOnly"]
        rel = a.pd_secret_file[len(mount["mountPath"]) :].lstrip("/")
        assert {"key": "pd-secret", "path": rel} in secret["items"]


def test_decode_advertises_its_pod_address_and_only_prefill_reaches_the_transfer_port():
    c = _container(_one("StatefulSet", "kvrelay-decode"))
    a = build_parser().parse_args(_args(c))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert a.transfer_port == ports["transfer"]
    (ip,) = [e for e in c["env"] if e["name"] == "POD_IP"]
    assert ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "--transfer-host=$(POD_IP)" in c["args"]
    pol = _one("NetworkPolicy", "kvrelay-transfer")
    assert pol["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "decode"
    (rule,) = pol["spec"]["ingress"]
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "prefill"
    assert [p["port"] for p in rule["ports"]] == [a.transfer_port]


def test_the_image_copies_what_exists():
    df = (DIR.parent / "Dockerfile").read_text()
    root = DIR.parents[1]
    for line in df.splitlines():
        if line.startswith("COPY "):
            *srcs, _ = line.split()[1:]
            for s in srcs:
                assert (root / s).exists(), s
