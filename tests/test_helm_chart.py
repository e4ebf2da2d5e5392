"""The Helm chart (helm/latentserve) renders, lints and validates for its default values and
every example, and the rendered objects carry what the values ask for.

Rendering and linting use Helm's own library (PyPI helm-python-sdk: no helm binary, no
cluster); core objects and the RayCluster's pod templates are checked against the Kubernetes
schemas shipped in kubernetes-validate; the RayCluster itself (a CRD) is checked field by
field here, and the controller's argv is parsed with latentserve's real CLI parser.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import re
import shlex
import subprocess

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from yamllint import config as yamllint_config
from yamllint import linter as yamllint_linter

from service.cli import build_parser
from service.config import PRESETS

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "latentserve"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
KUBE_VERSION = "1.33.0"  # DRA (ComputeDomain claims) is GA from 1.34, present since 1.32
RELEASE, NAMESPACE = "rel", "ml"
CASES = [pytest.param({}, id="default")] + [
    pytest.param(yaml.safe_load(p.read_text()), id=p.stem) for p in EXAMPLES
]
# Rendered manifests interleave hand-written and toYaml-indented lists; line length is the
# templates' business, not the cluster's.
RENDERED_YAMLLINT = yamllint_config.YamlLintConfig(
    "extends: default\nrules: {document-start: disable, line-length: disable, "
    "indentation: {indent-sequences: whatever}}"
)
SOURCE_YAMLLINT = yamllint_config.YamlLintConfig(
    "extends: default\nrules: {document-start: disable, line-length: {max: 110}}"
)


@functools.cache
def chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def render_text(values: dict) -> dict[str, str]:
    return chart().render(values=values, name=RELEASE, namespace=NAMESPACE)


def render(values: dict) -> dict[str, list[dict]]:
    """Rendered objects by kind (NOTES.txt left out)."""
    by_kind: dict[str, list[dict]] = {}
    for path, text in render_text(values).items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def one(objs: dict[str, list[dict]], kind: str) -> dict:
    assert len(objs.get(kind, [])) == 1, f"expected one {kind}, got {len(objs.get(kind, []))}"
    return objs[kind][0]


def container(pod_template: dict) -> dict:
    (c,) = pod_template["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def serve_argv(head: dict) -> list[str]:
    """argv of `latentserve serve` from the head's start script (its exec line)."""
    script = container(head)["args"][0]
    lines = [ln for ln in script.splitlines() if ln.startswith("exec latentserve serve ")]
    assert len(lines) == 1, script
    return shlex.split(lines[0])[1:]


def parse_serve(argv: list[str]) -> argparse.Namespace:
    """Parse with the real CLI, refusing abbreviated flags (argparse would accept them)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    known = set(sub.choices["serve"]._option_string_actions)
    assert argv[:2] == ["latentserve", "serve"], argv
    unknown = [a for a in argv if a.startswith("--") and a.split("=")[0] not in known]
    assert not unknown, f"not flags of latentserve serve: {unknown}"
    return build_parser().parse_args(argv[1:])


def gpu_group(rc: dict, name: str) -> dict:
    groups = [g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == name]
    assert len(groups) == 1, [g["groupName"] for g in rc["spec"]["workerGroupSpecs"]]
    return groups[0]


# ---- lint and validation ----------------------------------------------------------------

@pytest.mark.parametrize("values", CASES)
def test_chart_lints_clean(values):
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("values", CASES)
def test_rendered_manifests_pass_yamllint(values):
    for path, text in render_text(values).items():
        if path.endswith("NOTES.txt") or not text.strip():
            continue
        problems = [str(p) for p in yamllint_linter.run(text, RENDERED_YAMLLINT)]
        assert not problems, f"{path}:\n" + "\n".join(problems)


def test_chart_sources_pass_yamllint():
    for path in [CHART / "Chart.yaml", CHART / "values.yaml", *EXAMPLES]:
        problems = [str(p) for p in yamllint_linter.run(path.read_text(), SOURCE_YAMLLINT)]
        assert not problems, f"{path}:\n" + "\n".join(problems)


@pytest.mark.parametrize("values", CASES)
def test_core_objects_and_pod_templates_match_kubernetes_schemas(values):
    objs = render(values)
    for kind in ("Service", "Secret"):
        for obj in objs.get(kind, []):
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    rc = one(objs, "RayCluster")
    templates = [rc["spec"]["headGroupSpec"]["template"]]
    templates += [g["template"] for g in rc["spec"]["workerGroupSpecs"]]
    for i, template in enumerate(templates):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"t{i}"}, "template": template}
        kubernetes_validate.validate(wrapped, KUBE_VERSION, strict=True)


# ---- the RayCluster carries what the values ask for -------------------------------------

@pytest.mark.parametrize("values", CASES)
def test_raycluster_structure(values):
    merged = chart().merge_values(values)
    ls = merged["latentserve"]
    rc = one(render(values), "RayCluster")
    assert rc["apiVersion"] == "ray.io/v1"
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    assert rc["spec"]["rayVersion"] == merged["rayVersion"]
    spec = rc["spec"]
    for params in [spec["headGroupSpec"]["rayStartParams"]] + [g["rayStartParams"] for g in spec["workerGroupSpecs"]]:
        assert isinstance(params, dict) and all(isinstance(v, str) for v in params.values()), params

    tp, gpn = ls["tp"], ls["gpusPerNode"]
    pods, gpus = (1, tp) if tp <= gpn else (tp // gpn, gpn)
    group = gpu_group(rc, merged["worker"]["groupName"])
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == pods
    assert pods * gpus == tp
    worker = container(group["template"])
    assert worker["name"] == "ray-worker"
    assert worker["resources"]["limits"][merged["worker"]["gpuResourceName"]] == gpus
    pod_spec = group["template"]["spec"]
    assert pod_spec.get("nodeSelector", {}) == merged["worker"]["nodeSelector"]
    assert pod_spec.get("tolerations", []) == merged["worker"]["tolerations"]
    assert "KUBERAY_GEN_RAY_START_CMD" in worker["args"][0]
    head = container(spec["headGroupSpec"]["template"])
    assert head["name"] == "ray-head"
    assert 'eval "${KUBERAY_GEN_RAY_START_CMD//--block/}"' in head["args"][0]
    for c in (head, worker):
        assert env_of(c)["NCCL_NVLS_ENABLE"]["value"] == "0"
        assert c["command"] == ["/bin/bash", "-c", "--"]


@pytest.mark.parametrize("values", CASES)
def test_head_command_starts_the_controller_with_the_values(values):
    ls = chart().merge_values(values)["latentserve"]
    rc = one(render(values), "RayCluster")
    argv = serve_argv(rc["spec"]["headGroupSpec"]["template"])
    args = parse_serve(argv)  # the real CLI must accept what the chart writes
    assert args.ray_address == "auto" and args.host == "0.0.0.0"
    assert (args.model, args.tp, args.port) == (ls["model"], ls["tp"], ls["port"])
    assert (args.device, args.dtype, args.fused_tail) == (ls["device"], ls["dtype"], ls["fusedTail"])
    assert args.enable_sleep_mode == ls["sleepMode"]["enabled"]
    assert args.sleep_preserve_parameter_names == ls["sleepMode"]["preserveParameterNames"]
    assert args.hf_overrides == (ls["hfOverrides"] or None)
    assert args.max_model_len == ls.get("maxModelLen")
    assert "--admin-key" not in argv, "the admin key must come from the Secret, not the argv"


@pytest.mark.parametrize("values", CASES)
def test_admin_key_comes_from_a_secret(values):
    key = chart().merge_values(values)["latentserve"]["adminKey"]
    objs = render(values)
    head = container(one(objs, "RayCluster")["spec"]["headGroupSpec"]["template"])
    ref = env_of(head)["LATENTSERVE_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["key"] == key["secretKey"]
    if key["existingSecret"]:
        assert ref["name"] == key["existingSecret"] and "Secret" not in objs
    else:
        secret = one(objs, "Secret")
        assert ref["name"] == secret["metadata"]["name"]
        assert len(secret["data"][key["secretKey"]]) > 0


@pytest.mark.parametrize("values", CASES)
def test_probes_service_and_servicemonitor_point_at_the_controller(values):
    merged = chart().merge_values(values)
    objs = render(values)
    rc = one(objs, "RayCluster")
    head = container(rc["spec"]["headGroupSpec"]["template"])
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["http"] == merged["latentserve"]["port"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert head[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    svc = one(objs, "Service")
    assert svc["spec"]["selector"] == {"ray.io/cluster": rc["metadata"]["name"], "ray.io/node-type": "head"}
    assert svc["spec"]["ports"] == [{"name": "http", "port": merged["service"]["port"], "targetPort": "http",
                                     "protocol": "TCP"}]
    monitors = objs.get("ServiceMonitor", [])
    assert len(monitors) == (1 if merged["serviceMonitor"]["enabled"] else 0)
    for sm in monitors:
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert sm["spec"]["endpoints"][0]["port"] == "http" and sm["spec"]["endpoints"][0]["path"] == "/metrics"


@pytest.mark.parametrize("values", CASES)
def test_model_source_and_mnnvl_reach_the_pods(values):
    merged = chart().merge_values(values)
    objs = render(values)
    rc = one(objs, "RayCluster")
    head_tpl = rc["spec"]["headGroupSpec"]["template"]
    group = gpu_group(rc, merged["worker"]["groupName"])
    src = merged["modelSource"]
    for tpl in (head_tpl, group["template"]):
        volumes = {v["name"]: v for v in tpl["spec"].get("volumes", [])}
        mounts = {m["name"]: m for m in container(tpl).get("volumeMounts", [])}
        if src["type"] == "none":
            assert "model" not in volumes and "model" not in mounts
            continue
        assert mounts["model"]["mountPath"] == src["mountPath"] and mounts["model"]["readOnly"] == src["readOnly"]
        if src["type"] == "pvc":
            assert volumes["model"]["persistentVolumeClaim"]["claimName"] == src["pvc"]["claimName"]
        else:
            assert volumes["model"]["hostPath"]["path"] == src["hostPath"]["path"]

    pod = group["template"]["spec"]
    if not merged["mnnvl"]["enabled"]:
        assert "ComputeDomain" not in objs and "resourceClaims" not in pod
        return
    domain = one(objs, "ComputeDomain")
    assert domain["apiVersion"] == "resource.nvidia.com/v1beta1"
    claims = {c["name"]: c["resourceClaimTemplateName"] for c in pod["resourceClaims"]}
    assert set(claims.values()) == {domain["spec"]["channel"]["resourceClaimTemplate"]["name"]}
    assert {c["name"] for c in container(group["template"])["resources"]["claims"]} == set(claims)
    (term,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == merged["mnnvl"]["cliqueTopologyKey"]
    assert term["labelSelector"]["matchLabels"] == {"ray.io/cluster": rc["metadata"]["name"],
                                                    "ray.io/group": group["groupName"]}
    assert "/dev/nvidia-caps-imex-channels" in container(group["template"])["args"][0]


# ---- values beyond the examples -------------------------------------------------------------

def test_hostpath_globs_extra_args_and_extra_groups():
    globs = ["model.layers.*.mlp.routed_expert_norm.weight", "lm_head.*", "model.norm.[w]eight"]
    values = {
        "latentserve": {"model": "/weights/ckpt", "tp": 2, "gpusPerNode": 8, "maxModelLen": 2048,
                        "sleepMode": {"enabled": True, "preserveParameterNames": globs},
                        "adminKey": {"create": False}, "extraArgs": ["--max-num-seqs", 128]},
        "modelSource": {"type": "hostPath", "mountPath": "/weights", "hostPath": {"path": "/data/ckpt"}},
        "additionalWorkerGroups": {"cpu": {"replicas": 2, "rayStartParams": {"num-cpus": 16}}},
    }
    objs = render(values)
    rc = one(objs, "RayCluster")
    args = parse_serve(serve_argv(rc["spec"]["headGroupSpec"]["template"]))
    assert args.sleep_preserve_parameter_names == globs  # quoted: no shell globbing on the head
    assert (args.model, args.tp, args.max_model_len, args.max_num_seqs) == ("/weights/ckpt", 2, 2048, 128)
    gpu, cpu = gpu_group(rc, "gpu"), gpu_group(rc, "cpu")
    assert gpu["replicas"] == 1 and container(gpu["template"])["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert cpu["replicas"] == 2 and cpu["rayStartParams"] == {"num-cpus": "16"}
    assert "nvidia.com/gpu" not in json.dumps(container(cpu["template"]).get("resources", {}))
    head = container(rc["spec"]["headGroupSpec"]["template"])
    assert "LATENTSERVE_ADMIN_KEY" not in env_of(head) and "Secret" not in objs
    assert "admin API is OFF" in render_text(values)["latentserve/templates/NOTES.txt"]


@pytest.mark.parametrize("values, message", [
    ({"latentserve": {"tp": 6}}, "not a multiple of latentserve.gpusPerNode"),
    ({"latentserve": {"model": "/models/x"}}, "modelSource.type is none"),
    ({"latentserve": {"model": "/elsewhere/x"}, "modelSource": {"type": "pvc", "pvc": {"claimName": "w"}}},
     "not under modelSource.mountPath"),
    ({"latentserve": {"model": "kimi"}}, "neither a preset"),
    ({"modelSource": {"type": "pvc"}}, "claimName is required"),
    ({"latentserve": {"sleepMode": {"enabled": False, "preserveParameterNames": ["*"]}}}, "needs latentserve.sleepMode.enabled"),
    ({"latentserve": {"sleepMode": {"preserveParameterNames": ["it's"]}}}, "single quote"),
    ({"mnnvl": {"enabled": True, "computeDomain": {"create": False}}}, "needs mnnvl.computeDomain.resourceClaimTemplateName"),
    ({"latentserve": {"fusedTail": "maybe"}}, "fusedTail"),
    ({"latentserve": {"preserveParameterNames": ["*"]}}, "preserveParameterNames"),
])
def test_values_that_cannot_work_are_refused(values, message):
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render_text(values)


# ---- the chart agrees with the rest of the repository ---------------------------------------

def test_ray_version_matches_the_pinned_ray():
    pins = dict(re.findall(r"^ray\[default\]==(\S+)()", (ROOT / "requirements.txt").read_text(), re.M))
    assert list(pins) == [chart().values["rayVersion"]]


def test_chart_presets_are_the_service_presets():
    source = (CHART / "templates" / "_helpers.tpl").read_text()
    block = re.search(r'define "latentserve.presets".*?\{\{- end', source, re.S).group(0)
    assert re.findall(r'"([a-z0-9-]+)"', block.split("list", 1)[1]) == list(PRESETS)


def bare_metal_env(*files: pathlib.Path) -> dict[str, str]:
    """The variables an env file chain exports, as ray-head.sh sees them."""
    script = 'set -a; for f in "$@"; do source "$f"; done; env -0'
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}  # nothing inherited from the test's shell
    out = subprocess.run(["bash", "-c", script, "bash", *map(str, files)], capture_output=True, check=True,
                         env=clean).stdout
    return dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_chart_example_matches_its_bare_metal_recipe(example):
    profile = ROOT / "deploy" / "env" / "gb200-mnnvl.env"
    recipe = ROOT / "deploy" / "examples" / f"{example.stem}.env"
    env = bare_metal_env(profile, recipe)
    merged = chart().merge_values(yaml.safe_load(example.read_text()))
    ls = merged["latentserve"]
    assert env["LATENTSERVE_MODEL"] == ls["model"]
    assert int(env["LATENTSERVE_TP"]) == ls["tp"]
    assert int(env["LATENTSERVE_GPUS_PER_NODE"]) == ls["gpusPerNode"]
    assert int(env["LATENTSERVE_NODES"]) * ls["gpusPerNode"] == ls["tp"]
    assert json.loads(env.get("LATENTSERVE_HF_OVERRIDES") or "{}") == ls["hfOverrides"]
    assert (env["LATENTSERVE_SLEEP_MODE"] == "1") == ls["sleepMode"]["enabled"]
    assert env["LATENTSERVE_PRESERVE_GLOBS"].split() == ls["sleepMode"]["preserveParameterNames"]
    assert env["LATENTSERVE_FUSED_TAIL"] == ls["fusedTail"] and env["LATENTSERVE_DTYPE"] == ls["dtype"]
    assert int(env.get("LATENTSERVE_MAX_MODEL_LEN") or 0) == (ls.get("maxModelLen") or 0)
    assert env.get("LATENTSERVE_EXTRA_ARGS", "").split() == [str(a) for a in ls["extraArgs"]]
    # The ranks get the same NCCL/NVLink environment on Kubernetes as on bare metal.
    rc = one(render(yaml.safe_load(example.read_text())), "RayCluster")
    pod_env = env_of(container(gpu_group(rc, merged["worker"]["groupName"])["template"]))
    wanted = {k: v for k, v in bare_metal_env(profile).items() if re.match(r"(NCCL|CUDA|TORCH_SYMM|NVSHMEM)_", k)}
    assert {k: pod_env[k]["value"] for k in wanted if k in pod_env} == wanted
    assert merged["mnnvl"]["enabled"] == (env.get("LATENTSERVE_REQUIRE_IMEX") == "1")
