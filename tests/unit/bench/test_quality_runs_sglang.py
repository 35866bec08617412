"""bench/gpu/quality_runs.py's SGLang stage calls `eagle3 evaluate` with overrides that must make a valid
configuration: measurement (b) alone, in SGLang, its site first on the server's PYTHONPATH."""

from __future__ import annotations

from pathlib import Path

from bench.gpu.quality_runs import CONFIG, sglang_sets
from eagle3_core.config import load_config


def test_the_sglang_stage_overrides_make_a_valid_config(tmp_path: Path) -> None:
    config = load_config(CONFIG, sglang_sets(tmp_path / "run", Path("/opt/sglang site")))
    evaluation = config.evaluation
    assert evaluation.engine == "sglang" and not evaluation.with_transformers and config.run_dir == tmp_path / "run"
    assert evaluation.sglang_env["PYTHONPATH"].startswith("/opt/sglang site")
    assert evaluation.sglang_args == ["--attention-backend", "triton", "--sampling-backend", "pytorch"]
