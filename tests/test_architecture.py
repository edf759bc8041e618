"""The layout as contracts: one import namespace, floors that only look down, a torch-free proxy,
node services that use only the engine's public API.

The wheel is built once from a copy of the checkout (setuptools' build folder would otherwise carry
stale modules between builds) and unpacked: an unpacked wheel is exactly what ``pip install .``
puts into site-packages.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("proxy", "prefill_node", "decode_node", "kv_transfer", "kernels")
_SKIP = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".airgap", ".*cache")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The wheel of this checkout, unpacked: a site-packages holding pdserve and nothing else."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    shutil.copytree(ROOT, src, ignore=_SKIP)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(work),
            ".",
        ],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = work.glob("pdserve-*.whl")
    site = work / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    return site


def test_wheel_installs_pdserve_alone(site):
    names = sorted(p.name for p in site.iterdir())
    assert names == ["pdserve", "pdserve-0.1.0.dist-info"], names
    for name in SUBPACKAGES:
        assert (site / "pdserve" / name / "__init__.py").is_file(), name


def test_fresh_venv_has_pdserve_and_no_generic_names(site, tmp_path):
    """In a fresh venv (no system packages) holding the installed wheel, ``import kernels`` fails
    and every subpackage resolves under pdserve."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, system_site_packages=False)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    for entry in site.iterdir():
        shutil.copytree(entry, Path(purelib) / entry.name)
    code = (
        "import importlib.util as u, sys\n"
        f"subs = {SUBPACKAGES!r}\n"
        "missing = [s for s in subs if u.find_spec('pdserve.' + s) is None]\n"
        "generic = [s for s in subs if u.find_spec(s) is not None]\n"
        "print(missing, generic)\n"
        "try:\n"
        "    import kernels\n"
        "except ModuleNotFoundError:\n"
        "    print('no kernels')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["[] []", "no kernels"], proc.stdout


def test_layer_contracts_hold(site):
    """import-linter's contracts in pyproject.toml: floors only look down, the proxy stays off the
    engine, the nodes and the transports."""
    lint = shutil.which("lint-imports")
    assert lint, "import-linter is a test dependency"
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [lint, "--no-cache", str(ROOT / "pyproject.toml")],
        cwd=site,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


NODE_DIRS = ("pdserve/node", "prefill_node", "decode_node")
ENGINE_INSIDES = ("scheduler", "runner")
"""``LLMEngine`` attributes that are its insides: the node reaches neither, by any name."""


def _reaches_into_the_engine(source: str) -> list[str]:
    """What in ``source`` reads the engine's insides or sets the old launch hook, as ``line: text``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr in ENGINE_INSIDES or (node.attr == "on_launch" and isinstance(node.ctx, ast.Store)):
            found.append((node.lineno, node.col_offset, ast.unparse(node)))
    return [f"{line}: {text}" for line, _, text in sorted(found)]


def test_the_check_for_reaching_into_the_engine_can_fail():
    source = "n = engine.scheduler.held\nx.runner.kv_cache\nstate.engine.on_launch = f\nengine.on_launch\n"
    found = _reaches_into_the_engine(source)
    assert found == ["1: engine.scheduler", "2: x.runner", "3: state.engine.on_launch"]


def test_node_services_use_only_the_engine_public_api():
    """No module of the node framework or the roles touches ``.scheduler`` or ``.runner`` (of the
    engine or anything else) or assigns an ``.on_launch`` hook: they call ``LLMEngine``'s methods."""
    files = sorted(p for d in NODE_DIRS for p in (ROOT / d).rglob("*.py"))
    assert len(files) >= 5, files
    found = [f"{p.relative_to(ROOT)}:{hit}" for p in files for hit in _reaches_into_the_engine(p.read_text())]
    assert found == []


def test_proxy_app_does_not_import_torch():
    code = (
        "import sys\n"
        "import pdserve.proxy.app, pdserve.proxy.server, pdserve.messages\n"
        "from pdserve.cli import build_parser\n"
        "build_parser()  # what `pdserve proxy` and `pdserve bench serve` run first\n"
        "heavy = ('torch', 'pdserve.engine.llm_engine', 'pdserve.kv_transfer')\n"
        "heavy = [m for m in heavy if m in sys.modules]\n"
        "print(heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_import_pdserve_is_lazy():
    code = "import sys, pdserve\nprint('torch' in sys.modules, pdserve.SamplingParams.__name__)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "SamplingParams"]


def _requirements(site: Path) -> list[str]:
    (meta,) = site.glob("pdserve-*.dist-info/METADATA")
    return [
        line.split(":", 1)[1].strip()
        for line in meta.read_text().splitlines()
        if line.startswith("Requires-Dist:")
    ]


def test_triton_and_nixl_come_only_where_they_are_used(site):
    """torch's CUDA builds bring triton, so pdserve itself never requires it (torch's CPU wheel and
    no triton is a whole install); the test extra takes one nixl build, not the meta package ``nixl``
    that pulls the CUDA 12 and CUDA 13 builds, which only the ``nixl`` extra asks for."""
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in _requirements(site)]

    def extras(name: str) -> set[str]:
        """The extras that require ``name`` ("" for a requirement of every install)."""
        found = set()
        for r in reqs:
            if r.name == name:
                marker = str(r.marker or "")
                found.add(marker.split("extra ==", 1)[1].strip(" '\"") if "extra ==" in marker else "")
        return found

    assert any(r.name == "torch" for r in reqs), reqs
    assert extras("triton") == {"test"}
    assert extras("nixl") == {"nixl"}
    assert extras("nixl-cu13") == {"test"}
    assert not extras("nixl-cu12")


def test_engine_runs_on_cpu_without_triton():
    """With triton unimportable, as after ``pip install torch==2.13.0 pdserve``: pdserve, the engine,
    the kernels' references and the KV transports import, and a CPU ``LLM.generate`` runs."""
    code = (
        "import sys\n"
        "class NoTriton:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'triton':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoTriton())\n"
        "import torch\n"
        "torch.set_num_threads(1)\n"
        "import pdserve.engine.llm_engine, pdserve.engine.model_runner, pdserve.engine.cuda_graphs\n"
        "import pdserve.kernels.paged_attention, pdserve.kernels.block_copy, pdserve.kv_transfer\n"
        "from pdserve import LLM, SamplingParams\n"
        "from pdserve.kernels.triton_utils import HAS_TRITON, count_jit_compiles, num_jit_compiles\n"
        "llm = LLM(model='random:tiny', max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)\n"
        "params = SamplingParams(max_tokens=4, ignore_eos=True)\n"
        "out = llm.generate([{'prompt_token_ids': [1, 2, 3]}], params)\n"
        "print(HAS_TRITON, count_jit_compiles(), num_jit_compiles(), llm.engine.load().num_jit_compiles)\n"
        "print(len(out[0].outputs[0].token_ids))\n"
        "try:\n"
        "    pdserve.kernels.block_copy.gather_blocks(torch.zeros(1, 2, 2, 4, 1, 8), torch.tensor([1]))\n"
        "except ModuleNotFoundError as e:\n"
        "    print('triton is not installed' in str(e))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == ["False False 0 0", "4", "True"], proc.stdout
