"""The acceptance guard's message and the report's rendering of both measurements."""

from __future__ import annotations

from pathlib import Path

from eagle3_core.evaluation.report import guard_message, write_report
from eagle3_core.evaluation.stats import AcceptanceStats

IDS = {"draft config layer ids": [2, 15, 27], "checkpoint layer ids": [2, 15, 27]}


def test_guard_passes_above_the_floor_and_names_causes_below_it() -> None:
    assert guard_message(0.35, 0.33, 0.2, IDS) is None
    assert guard_message(0.35, None, 0.2, IDS) is None
    message = guard_message(0.05, 0.04, 0.2, IDS)
    assert message is not None
    assert "transformers (a) 0.050, vLLM (b) 0.040" in message
    for cause in ("aux layer ids", "weight names", "d2t offsets", "chat template"):
        assert cause in message
    assert "engine-side" not in message and "layer ids differ" not in message


def test_guard_points_at_the_engine_when_only_vllm_is_low() -> None:
    message = guard_message(0.4, 0.02, 0.2, IDS)
    assert message is not None and "engine-side" in message


def test_guard_points_at_layer_ids_that_differ_from_training() -> None:
    ids = {"draft config layer ids": [3, 16, 28], "checkpoint layer ids": [2, 15, 27]}
    message = guard_message(0.01, None, 0.2, ids)
    assert message is not None and "[3, 16, 28]" in message and "layer ids differ" in message


def summary(guard: str | None) -> dict:
    a = AcceptanceStats(5, 10, [6, 4, 2, 1, 0])
    b = AcceptanceStats(3, 12, [7, 4, 2])
    hf_set = {"prompts": 2, "tokens": 40, "acceptance": a.to_json(), "tau_by_k": a.tau_by_k(), "draft_share": 0.2,
              "target_share": 0.8, "identical_to_greedy": "2/2"}  # fmt: skip
    rate = {"tokens": 100, "wall_s": 2.0, "tokens_per_s": 50.0}
    vllm_set = {"acceptance": b.to_json(), "identical_outputs": "2/2",
                "batch1": {"draft": rate, "plain": rate, "speedup": 1.25},
                "concurrent": {"draft": rate, "plain": rate, "speedup": 0.9}}  # fmt: skip
    return {"draft": "d", "target": "t", "k": 3, "max_new_tokens": 20, "floor": 0.2, "guard": guard,
            "transformers": {"k": 5, "dtype": "float32", "sets": {"humaneval": hf_set}},
            "vllm": {"k": 3, "sets": {"humaneval": vllm_set}}}  # fmt: skip


def test_report_shows_both_measurements_side_by_side(tmp_path: Path) -> None:
    markdown, png = write_report(summary(None), tmp_path)
    text = markdown.read_text()
    assert f"| humaneval | 2 | {1 + 1.2:.3f} | {1 + 1.3:.3f} | {1 + 13 / 12:.3f} | 1.25 | 0.90 |" in text
    assert "| humaneval | (a) transformers | 0.600 | 0.400 | 0.200 | 0.100 | 0.000 |" in text
    assert "| humaneval | (b) vLLM | 0.583 | 0.333 | 0.167 | — | — |" in text
    assert "Guard**: passed" in text
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
    failed, _ = write_report(summary("position-0 acceptance below"), tmp_path)
    assert "**Guard: FAILED**" in failed.read_text()


def test_report_with_vllm_only(tmp_path: Path) -> None:
    """A target too large for transformers is measured in vLLM alone; the report says so."""
    only_vllm = summary(None)
    only_vllm["transformers"] = {"k": 5, "dtype": "float32", "sets": {}, "skipped": "with_transformers is false"}
    markdown, png = write_report(only_vllm, tmp_path)
    text = markdown.read_text()
    assert f"| humaneval | — | — | — | {1 + 13 / 12:.3f} | 1.25 | 0.90 |" in text
    assert "(a) not measured: with_transformers is false" in text and "τ by k" not in text
    assert "(a) not run (with_transformers is false); (b) vLLM, served with the draft" in text
    assert "chain speculative decoding in transformers" not in text
    assert png.stat().st_size > 10_000


def test_report_flags_a_speedup_above_tau_as_noise(tmp_path: Path) -> None:
    """τ = 1 + 13/12 ≈ 2.08 here: 2.5× cannot come from the draft, only from a busy machine during one run."""
    noisy = summary(None)
    noisy["vllm"]["sets"]["humaneval"]["batch1"]["speedup"] = 2.5
    markdown, _ = write_report(noisy, tmp_path)
    assert f"| {1 + 13 / 12:.3f} | 2.50 (noise: above τ) | 0.90 |" in markdown.read_text()


def test_report_says_why_bf16_outputs_of_a_leave_plain_greedy(tmp_path: Path) -> None:
    """In bfloat16 a k+1-token verification rounds differently from one-token steps: (a)'s lossless check
    names such a departure a near-tie, and the report says so instead of showing a bare `2/3`."""
    data = summary(None)
    data["transformers"]["dtype"] = "bfloat16"
    departed = {"prompt": "humaneval/3", "token": 17, "gap": 0.02, "near_tie": True}
    data["transformers"]["sets"]["humaneval"] |= {
        "identical_to_greedy": "2/3", "differences": [departed], "near_ties": 1, "defects": []
    }  # fmt: skip
    text = write_report(data, tmp_path)[0].read_text()
    assert "| 2/3; near-ties 1; defects 0 |" in text
    assert "(a) in bfloat16: 1 output(s) leave plain greedy at a near-tie" in text
    assert "not lossless" not in text
    data["transformers"]["sets"]["humaneval"] |= {"near_ties": 0, "defects": ["humaneval/3"]}
    text = write_report(data, tmp_path)[0].read_text()
    assert "| 2/3; near-ties 0; defects 1 (humaneval/3) |" in text and "not lossless" in text
