"""A vLLM /metrics scrape holding only the speculative-decoding counters, for tests that read acceptance from it."""

from __future__ import annotations


def scrape(drafts: float, per_pos: list[float]) -> str:
    """The counters after `drafts` verification steps that accepted `per_pos[i]` tokens at draft position i."""
    lines = [
        f'vllm:spec_decode_num_drafts_total{{engine="0"}} {drafts}',
        f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {drafts * len(per_pos)}',
        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {sum(per_pos)}',
    ]
    lines += [
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{i}"}} {v}'
        for i, v in enumerate(per_pos)
    ]
    return "\n".join(lines)
