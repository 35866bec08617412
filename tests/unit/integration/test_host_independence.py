"""The integration suite asserts the same thing on every host CI can get. `auto` compute dtypes resolve to
bfloat16 on CPUs with bf16 instructions (avx512_bf16, AMX) and to float32 on AVX2-only ones, so a test
that leaves one at `auto` checks float32 behaviour on one kind of host and bfloat16 on the other (a
lossless check in bf16 flips near-ties: `test_speculative_output_equals_greedy_on_smollm2` failed on an
avx512_bf16 EPYC only). Every config an integration test builds must resolve alike on both kinds."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from eagle3_core import dtypes
from eagle3_core.config import PipelineConfig, load_config

AVX2_ONLY = ("AMD EPYC (Zen 2)", frozenset({"avx", "avx2", "fma"}))
AVX512_BF16 = ("AMD EPYC (Zen 4)", frozenset({"avx2", "avx512f", "avx512_bf16"}))


INTEGRATION = Path(__file__).parents[2] / "integration"
# Every config builder of tests/integration, called as its tests call it: module -> (module, run dir) -> config.
BUILDERS: dict[str, Callable[[Any, Path], PipelineConfig]] = {
    "test_conversations_vllm": lambda m, tmp: PipelineConfig.model_validate(
        m.turns_config(tmp, str(tmp), "http://127.0.0.1:1/v1", tmp / "chat.jsonl")
    ),
    "test_deepseek_vllm": lambda m, tmp: m.pipeline_config(tmp),
    "test_engine_death": lambda m, tmp: m.small_config(tmp),
    "test_evaluation_vllm": lambda m, tmp: m.pipeline_config(tmp),
    "test_extraction_vllm": lambda m, tmp: m.make_config(tmp, "vllm"),
    "test_flow_engines": lambda m, tmp: load_config(m.write_config(tmp, "a", 4, 8)[0]),
    "test_flow_faults": lambda m, tmp: m.small_config(tmp, str(tmp / "tiny-llama")),
    "test_flow_ui": lambda m, tmp: PipelineConfig.model_validate({**m.TINY, "run_dir": str(tmp)}),
    "test_hosts_flow": lambda m, tmp: m.config_for(tmp, "http://127.0.0.1:1/v1", hosts=2),
    "test_hosts_killed": lambda m, tmp: m.config_for(tmp),
    "test_reuse_server": lambda m, tmp: m.make_config(tmp, "on"),
    "test_sampling_vllm": lambda m, tmp: m.config_for(tmp),
    "test_training_torchrun": lambda m, tmp: m.run_config(tmp, tmp),
}
# Unit modules whose assertions hold in one dtype only (measurement (a) identical to plain greedy): dotted path.
UNIT_BUILDERS: dict[str, Callable[[Any, Path], PipelineConfig]] = {
    "eagle3_core.evaluation.test_evaluation_phase": lambda m, tmp: m.make_config(tmp),
}


def resolved_on(host: tuple[str, frozenset[str]], build: Callable[[], PipelineConfig], monkeypatch) -> dict:
    """The compute dtypes `build`'s config resolves to on a CPU-only host with `host`'s flags."""
    with monkeypatch.context() as patch:
        patch.setattr(dtypes, "host_cpu", lambda: host)
        patch.setattr(dtypes, "cuda_present", lambda: False)
        return dtypes.resolved_dtypes(build())


def test_every_integration_module_that_builds_a_config_is_checked() -> None:
    building = {p.stem for p in INTEGRATION.glob("test_*.py") if "PipelineConfig" in p.read_text()}
    assert building - set(BUILDERS) <= {"test_disk_full", "test_export_vllm", "test_secrets", "test_prepare_target"}


CHECKED = {f"tests.integration.{m}": b for m, b in BUILDERS.items()} | {
    f"tests.unit.{m}": b for m, b in UNIT_BUILDERS.items()
}


@pytest.mark.parametrize("module", sorted(CHECKED))
def test_test_config_resolves_alike_on_every_ci_host(module: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(INTEGRATION))  # the modules import their siblings (training_flow) by name
    build = functools.partial(CHECKED[module], importlib.import_module(module), tmp_path)
    on_avx2, on_bf16 = resolved_on(AVX2_ONLY, build, monkeypatch), resolved_on(AVX512_BF16, build, monkeypatch)
    assert on_avx2 == on_bf16, f"{module} leaves a compute dtype at auto: {on_avx2} vs {on_bf16}"
