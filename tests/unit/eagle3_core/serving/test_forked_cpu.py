"""The vLLM platform plugin: inactive unless asked for, and then vLLM's CPU platform with forked engine
processes."""

from __future__ import annotations

import os

import pytest
from vllm.platforms.cpu import CpuPlatform
from vllm.utils.import_utils import resolve_obj_by_qualname

from eagle3_core.serving.forked_cpu import ForkedCpuPlatform
from eagle3_core.serving.vllm_plugin import CPU_FORK, forked_cpu_platform


def test_the_plugin_stays_inactive_unless_the_variable_asks_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CPU_FORK, raising=False)
    assert forked_cpu_platform() is None
    monkeypatch.setenv(CPU_FORK, "0")
    assert forked_cpu_platform() is None
    monkeypatch.setenv(CPU_FORK, "1")
    platform = resolve_obj_by_qualname(forked_cpu_platform())
    assert platform is ForkedCpuPlatform and issubclass(platform, CpuPlatform)


def test_the_platform_forks_where_vllms_cpu_platform_spawns(monkeypatch: pytest.MonkeyPatch) -> None:
    def vllm_cpu_check(cls, vllm_config) -> None:  # the one line of CpuPlatform's check this subclass undoes
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(vllm_cpu_check))
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    CpuPlatform.check_and_update_config(None)
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    ForkedCpuPlatform.check_and_update_config(None)
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
