"""bench/gpu/sglang_acceptance.py's pure parts: the server command and SGLang's acceptance turned into vLLM's
definitions (the GPU run itself needs the H200)."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest

from bench.gpu.sglang_acceptance import acceptance, sglang_command


def test_acceptance_follows_vllms_definitions_from_the_per_step_histograms() -> None:
    # Two requests: verify steps accepting 0, 1, 2, 3 draft tokens.
    metas = [{"spec_correct_drafts_histogram": [2, 1, 0, 1]}, {"spec_accept_histogram": [1, 1, 2, 0]}]
    result = acceptance(metas, 3)
    assert result["verify_steps"] == 8
    assert result["per_position"] == [5 / 8, 3 / 8, 1 / 8]  # steps accepting more than 0, 1, 2 tokens
    assert result["tau"] == 1 + 9 / 8


def test_a_reply_without_the_histogram_is_refused() -> None:
    with pytest.raises(ValueError, match="no acceptance histogram"):
        acceptance([{"spec_verify_ct": 3}], 3)


def test_the_draft_runs_as_an_eagle3_chain_on_the_triton_backend() -> None:
    command = sglang_command(Path("/t"), Path("/d"), 3, 8123, "float32", cuda_graph=False)
    pairs = dict(pairwise(command))  # each flag -> the word after it
    assert pairs["--speculative-algorithm"] == "EAGLE3" and pairs["--speculative-draft-model-path"] == "/d"
    assert (pairs["--speculative-num-steps"], pairs["--speculative-eagle-topk"]) == ("3", "1")
    assert pairs["--speculative-num-draft-tokens"] == "4" and pairs["--attention-backend"] == "triton"
    assert "--disable-cuda-graph" in command
    assert "--speculative-algorithm" not in sglang_command(Path("/t"), None, 3, 8123, "float32", cuda_graph=True)
