"""Acceptance statistics and vLLM's /metrics: the counters, their difference, and tau."""

from __future__ import annotations

import pytest

from eagle3_core.evaluation.stats import AcceptanceStats
from eagle3_core.evaluation.vllm_measure import parse_prometheus, spec_counters
from tests.helpers.vllm_metrics import scrape

SCRAPE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/m/smol"} 100.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="/m/smol"} 1.7645e+09
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/m/smol"} 300.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/m/smol"} 90.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m/smol",position="0"} 50.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m/smol",position="1"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m/smol",position="2"} 10.0
vllm:generation_tokens_total{engine="0",model_name="/m/smol"} 1234.0
"""


def test_parse_prometheus_reads_labels_and_values() -> None:
    samples = parse_prometheus(SCRAPE)
    assert ("vllm:generation_tokens_total", {"engine": "0", "model_name": "/m/smol"}, 1234.0) in samples
    assert not any(name.startswith("#") for name, _, _ in samples)


def test_spec_counters_give_vllm_acceptance_length_and_rates() -> None:
    stats = spec_counters(SCRAPE).to_stats()
    assert stats.k == 3 and stats.drafts == 100
    assert stats.per_position == pytest.approx([0.5, 0.3, 0.1])
    assert stats.acceptance_length == pytest.approx(1 + 90 / 100)


def test_counters_are_summed_over_engines_and_diffed_between_scrapes() -> None:
    two_engines = SCRAPE + SCRAPE.replace('engine="0"', 'engine="1"')
    assert spec_counters(two_engines).drafts == 200
    before, after = spec_counters(scrape(100, [50, 30, 10])), spec_counters(scrape(180, [90, 50, 20]))
    delta = after.minus(before).to_stats()
    assert delta.drafts == 80 and delta.accepted == [40, 20, 10]
    assert delta.acceptance_length == pytest.approx(1 + 70 / 80)


def test_a_server_without_drafter_has_no_counters() -> None:
    with pytest.raises(ValueError, match="no speculative-decoding counters"):
        spec_counters('vllm:generation_tokens_total{engine="0"} 5.0\n')


def test_inconsistent_per_position_counts_are_rejected() -> None:
    with pytest.raises(ValueError, match="do not add up"):
        spec_counters(SCRAPE.replace("} 90.0", "} 91.0")).to_stats()


def test_acceptance_stats_count_chain_prefixes() -> None:
    stats = AcceptanceStats(k=3)
    for accepted in (0, 1, 3, 2, 3):
        stats.add_step(accepted)
    assert stats.drafts == 5 and stats.accepted == [4, 3, 2]
    assert stats.acceptance_length == pytest.approx(1 + 9 / 5)
    assert stats.per_position == pytest.approx([0.8, 0.6, 0.4])
    with pytest.raises(ValueError):
        stats.add_step(4)


def test_tau_for_smaller_k_is_the_prefix_of_the_per_position_rates() -> None:
    stats = AcceptanceStats(k=5)
    steps = [0, 5, 2, 1, 4, 3, 5, 0]
    for accepted in steps:
        stats.add_step(accepted)
    for k in range(1, 6):
        # What a k-token run accepts at the same steps: the prefix, capped at k.
        expected = 1 + sum(min(a, k) for a in steps) / len(steps)
        assert stats.tau_for_k(k) == pytest.approx(expected)
        assert stats.truncated(k).acceptance_length == pytest.approx(expected)
    assert stats.tau_by_k()[-1] == pytest.approx(stats.acceptance_length)
    with pytest.raises(ValueError):
        stats.tau_for_k(6)
    merged = stats.merge(AcceptanceStats.from_json(stats.to_json()))
    assert merged.drafts == 16 and merged.acceptance_length == pytest.approx(stats.acceptance_length)
