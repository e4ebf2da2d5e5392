"""One way to install: the README, the docs and the Dockerfile all install latentserve from the
repository's pinned requirements files plus the package itself, and nothing else; the
Dockerfile copies everything that install reads; the bare-metal recipes start what their
examples say.

The README's commands are read from its fenced code blocks: every command there that runs
`pip install` counts (e.g. `.venv/bin/pip install -r requirements-cpu.txt -e .`).
"""

from __future__ import annotations

import json
import os
import pathlib
import posixpath
import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass, field

import pytest

from service.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Packages only the CUDA build needs; anything else the CUDA file adds is a second way.
GPU_ONLY = {"cuda-bindings", "triton"}
# pip options that change how, not what, gets installed.
HARMLESS_OPTIONS = {"--no-cache-dir", "-q", "--quiet", "--progress-bar=off", "--disable-pip-version-check"}


@dataclass
class PipInstall:
    requirement_files: list[str] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)  # positional: ".", a package name, a path
    editable: list[str] = field(default_factory=list)
    options: list[str] = field(default_factory=list)


def simple_commands(snippet: str) -> list[list[str]]:
    """The simple commands of a shell snippet (continuations joined, split at && || ; |)."""
    commands: list[list[str]] = []
    for line in snippet.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.commenters = "#"
        lexer.whitespace_split = True
        current: list[str] = []
        for token in lexer:
            if token in ("&&", "||", ";", "|", "&"):
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
    return [c for c in commands if c]


def pip_installs(snippet: str) -> list[PipInstall]:
    found = []
    for cmd in simple_commands(snippet):
        words = [w for w in cmd if "=" not in w or w.startswith("-")]  # drop VAR=value prefixes
        for i, word in enumerate(words[:-1]):
            is_pip = posixpath.basename(word) in ("pip", "pip3") or (word == "pip" and i and words[i - 1] == "-m")
            if is_pip and words[i + 1] == "install":
                found.append(parse_pip_args(words[i + 2:]))
                break
    return found


def parse_pip_args(args: list[str]) -> PipInstall:
    out = PipInstall()
    it = iter(args)
    for a in it:
        if a in ("-r", "--requirement"):
            out.requirement_files.append(next(it))
        elif a.startswith("-r") and len(a) > 2:
            out.requirement_files.append(a[2:])
        elif a in ("-e", "--editable"):
            out.editable.append(next(it))
        elif a.startswith("-"):
            out.options.append(a)
        else:
            out.targets.append(a)
    return out


def fenced_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", markdown, re.S | re.M)


def requirement_lines(name: str) -> list[str]:
    """A requirements file's requirement lines, -r includes followed, comments dropped."""
    lines = []
    for raw in (ROOT / name).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("-r"):
            lines += requirement_lines(line[2:].strip())
        elif line:
            lines.append(line)
    return lines


def includes(name: str) -> set[str]:
    """The requirements files `name` reads, itself included."""
    seen = {name}
    for raw in (ROOT / name).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("-r"):
            seen |= includes(line[2:].strip())
    return seen


def pins(name: str) -> dict[str, str]:
    out = {}
    for line in requirement_lines(name):
        m = re.match(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)", line)
        out[m.group(1).lower()] = m.group(3)
    return out


# ---- the Dockerfile ---------------------------------------------------------------------------

@dataclass
class Instruction:
    keyword: str
    rest: str
    workdir: str


def dockerfile() -> list[Instruction]:
    text = (ROOT / "Dockerfile").read_text()
    logical, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # comment inside a continued instruction
            continue
        buf += line.rstrip("\\").rstrip() + ("\n" if line.endswith("\\") else "")
        if not line.endswith("\\"):
            logical.append(buf)
            buf = ""
    out, workdir = [], "/"
    for line in logical:
        keyword, _, rest = line.strip().partition(" ")
        keyword = keyword.upper()
        if keyword == "WORKDIR":
            workdir = posixpath.join(workdir, rest.strip())
        out.append(Instruction(keyword, rest.strip(), workdir))
    return out


def run_script(rest: str) -> str:
    """A RUN instruction's shell command, without its --mount/--network flags."""
    return re.sub(r"^(--\S+\s+)+", "", rest)


def dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    excluded = False
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def test_the_dockerfile_installs_one_way():
    installs = [(i, p) for i in dockerfile() if i.keyword == "RUN" for p in pip_installs(run_script(i.rest))]
    assert len(installs) == 1, "the image installs Python packages in exactly one pip command"
    (instr, pip), = installs
    assert pip.requirement_files == ["requirements-cuda.txt"]
    assert pip.targets == ["."] and not pip.editable, "the image installs the package itself, non-editable"
    assert set(pip.options) <= HARMLESS_OPTIONS, pip.options
    venvs = [c for c in simple_commands(run_script(instr.rest)) if c[1:3] == ["-m", "venv"]]
    assert venvs and venvs[0][0] == "python3", "a venv made with python3 -m venv, as in the README"


def test_the_dockerfile_copies_what_the_install_reads():
    instructions = dockerfile()
    run_at = next(k for k, i in enumerate(instructions) if i.keyword == "RUN" and pip_installs(run_script(i.rest)))
    workdir = instructions[run_at].workdir
    (pip,) = pip_installs(run_script(instructions[run_at].rest))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed_files = {"pyproject.toml", project["project"]["readme"]}
    for f in pip.requirement_files:
        needed_files |= includes(f)
    needed_dirs = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}

    copied: dict[str, str] = {}  # image path -> repository path
    for instr in instructions[:run_at]:
        if instr.keyword != "COPY":
            continue
        *sources, dest = [w for w in instr.rest.split() if not w.startswith("--")]
        dest = posixpath.join(instr.workdir, dest)
        for src in sources:
            name = src.rstrip("/")
            target = posixpath.join(dest, posixpath.basename(name)) if dest.endswith("/") and (ROOT / name).is_file() \
                else dest.rstrip("/")
            copied[posixpath.normpath(target)] = name
    for rel in sorted(needed_files | needed_dirs):
        image_path = posixpath.normpath(posixpath.join(workdir, rel))
        assert copied.get(image_path) == rel, f"{rel} is not copied to {image_path} before the install"
        repo_files = [rel] if (ROOT / rel).is_file() else [
            str(p.relative_to(ROOT)) for p in (ROOT / rel).rglob("*.py") if "__pycache__" not in p.parts]
        assert repo_files, rel
        excluded = [f for f in repo_files if dockerignore_excludes(f)]
        assert not excluded, f".dockerignore keeps these out of the build context: {excluded}"


def test_the_image_runs_the_service_as_a_non_root_user_with_a_health_check():
    instructions = dockerfile()
    base = next(i.rest for i in instructions if i.keyword == "FROM")
    args = dict(re.findall(r"^(\w+)=(\S+)", "\n".join(i.rest for i in instructions if i.keyword == "ARG"), re.M))
    image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), base.split()[0])
    assert re.search(r":\d+\.\d+\.\d+-", image) and "latest" not in image, f"base image not pinned: {image}"
    user = [i.rest for i in instructions if i.keyword == "USER"][-1]
    assert user.split(":")[0] not in ("root", "0")
    assert json.loads(next(i.rest for i in instructions if i.keyword == "ENTRYPOINT")) == ["latentserve", "serve"]
    health = next(i.rest for i in instructions if i.keyword == "HEALTHCHECK")
    env = " ".join(i.rest for i in instructions if i.keyword == "ENV")
    assert "/health" in health + env


# ---- README and docs --------------------------------------------------------------------------

def readme_installs() -> list[PipInstall]:
    return [p for block in fenced_blocks((ROOT / "README.md").read_text()) for p in pip_installs(block)]


def test_the_readme_and_the_dockerfile_install_the_same_way():
    readme = readme_installs()
    assert readme, "README.md shows no `pip install` command in a fenced code block"
    (docker,) = [p for i in dockerfile() if i.keyword == "RUN" for p in pip_installs(run_script(i.rest))]
    for pip in readme:
        assert pip.editable == ["."] and not pip.targets, f"README installs the package itself (-e .): {pip}"
        assert set(pip.options) <= HARMLESS_OPTIONS, pip.options
        runtime = [f for f in pip.requirement_files if "test" not in f]
        assert runtime == ["requirements-cpu.txt"], f"README's runtime requirements: {runtime}"
    (cuda,) = docker.requirement_files
    # Both resolve to the same runtime pins; they differ only in the torch build's extras.
    assert "requirements.txt" in includes("requirements-cpu.txt") & includes(cuda)
    cpu_pins, cuda_pins = pins("requirements-cpu.txt"), pins(cuda)
    assert cpu_pins["torch"] == cuda_pins["torch"] and cpu_pins["torch"].startswith("=="), (cpu_pins, cuda_pins)
    assert set(cpu_pins) <= set(cuda_pins)
    assert set(cuda_pins) - set(cpu_pins) <= GPU_ONLY, set(cuda_pins) - set(cpu_pins)


DOCS = sorted(p for p in [*ROOT.glob("docs/*.md"), ROOT / "deploy" / "README.md", ROOT / "helm" / "latentserve" / "README.md"]
              if p.exists())


@pytest.mark.parametrize("doc", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_docs_install_only_from_the_requirements_files(doc):
    for block in fenced_blocks(doc.read_text()):
        for pip in pip_installs(block):
            assert not pip.targets and pip.editable == ["."], f"{doc.name}: {pip}"
            assert all((ROOT / f).is_file() for f in pip.requirement_files), pip.requirement_files
            assert set(pip.options) <= HARMLESS_OPTIONS, pip.options


def test_the_parser_reads_the_readme_format():
    sample = ("```bash\npython3 -m venv .venv && .venv/bin/pip install -r requirements-cpu.txt -e . "
              "&& .venv/bin/latentserve serve --model tiny --tp 2\n```\n\n```\n"
              "python3 -m venv .venv && .venv/bin/pip install -r requirements-cpu.txt \\\n"
              "  -r requirements-test.txt -e . && .venv/bin/python -m pytest\n```\n")
    found = [p for b in fenced_blocks(sample) for p in pip_installs(b)]
    assert [p.requirement_files for p in found] == [["requirements-cpu.txt"],
                                                    ["requirements-cpu.txt", "requirements-test.txt"]]
    assert all(p.editable == ["."] and not p.targets for p in found)
    assert pip_installs("pip install torch")[0].targets == ["torch"]


# ---- bare-metal recipes ------------------------------------------------------------------------

PROFILE = ROOT / "deploy" / "env" / "gb200-mnnvl.env"
RECIPES = sorted((ROOT / "deploy" / "examples").glob("*.env"))


def clean_env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **extra}


def recipe_env(*env_files: pathlib.Path) -> dict[str, str]:
    """What the env files export, read by bash as the scripts read them."""
    script = 'set -a; for f in "$@"; do source "$f"; done; env -0'
    out = subprocess.run(["bash", "-c", script, "bash", *map(str, env_files)], capture_output=True, check=True,
                         env=clean_env()).stdout
    return dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)


def dry_run(script: str, *env_files: pathlib.Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "deploy" / script), *map(str, env_files)], capture_output=True,
                          text=True, timeout=30,
                          env=clean_env(LATENTSERVE_DRY_RUN="1", LATENTSERVE_NODE_IP="192.0.2.10", **env))


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_bare_metal_recipe_starts_what_it_says(recipe):
    head = dry_run("ray-head.sh", PROFILE, recipe)
    assert head.returncode == 0, head.stderr
    lines = head.stdout.splitlines()
    assert "env NCCL_NVLS_ENABLE=0" in lines and "env NCCL_MNNVL_ENABLE=1" in lines
    (ray,) = [shlex.split(ln[2:]) for ln in lines if ln.startswith("+ ray start")]
    settings = recipe_env(PROFILE, recipe)
    gpn = settings["LATENTSERVE_GPUS_PER_NODE"]
    assert "--head" in ray and f"--num-gpus={gpn}" in ray and "--node-ip-address=192.0.2.10" in ray
    (serve,) = [shlex.split(ln[len("+ exec "):]) for ln in lines if ln.startswith("+ exec latentserve")]
    args = build_parser().parse_args(serve[1:])
    assert args.ray_address == "auto" and args.tp == int(settings["LATENTSERVE_TP"])
    assert args.enable_sleep_mode == (settings["LATENTSERVE_SLEEP_MODE"] == "1")
    assert args.sleep_preserve_parameter_names == settings["LATENTSERVE_PRESERVE_GLOBS"].split()
    assert "LATENTSERVE_ADMIN_KEY is not set" in head.stderr

    worker = dry_run("ray-worker.sh", PROFILE, recipe, RAY_HEAD_ADDRESS="192.0.2.10:6379")
    assert worker.returncode == 0, worker.stderr
    (ray,) = [shlex.split(ln[len("+ exec "):]) for ln in worker.stdout.splitlines() if ln.startswith("+ exec ray")]
    assert ray[:2] == ["ray", "start"] and "--address=192.0.2.10:6379" in ray and "--block" in ray
    assert f"--num-gpus={gpn}" in ray


@pytest.mark.parametrize("env, message", [
    ({"LATENTSERVE_NODES": "3"}, "must equal LATENTSERVE_NODES=3"),
    ({"LATENTSERVE_SLEEP_MODE": "0"}, "needs LATENTSERVE_SLEEP_MODE=1"),
])
def test_bare_metal_recipe_refuses_settings_that_cannot_work(env, message, tmp_path):
    override = tmp_path / "override.env"
    override.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    result = dry_run("ray-head.sh", PROFILE, ROOT / "deploy" / "examples" / "gb200-tp8-2x4.env", override)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_worker_needs_the_head_address():
    result = dry_run("ray-worker.sh", PROFILE, ROOT / "deploy" / "examples" / "gb200-tp8-2x4.env")
    assert result.returncode != 0 and "RAY_HEAD_ADDRESS is not set" in result.stderr
