"""Measurement (b)'s passes on one server: a batch-1 pass per prompt set (outputs, acceptance) and a
concurrent pass for throughput, which at `evaluation.concurrency` 1 would repeat the batch-1 pass request for
request, so it is not sent again."""

from __future__ import annotations

from collections import Counter

import pytest

from eagle3_core.evaluation.prompts import EvalPrompt
from eagle3_core.evaluation.served import measure_on_server
from eagle3_core.evaluation.stats import AcceptanceStats
from eagle3_core.progress import ignore_progress


class CountingServer:
    """A served target answering every prompt with its id; counts the requests per prompt."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()

    def model_id(self) -> str:
        return "m"

    def chat(self, model: str, prompt: EvalPrompt, max_tokens: int) -> tuple[str, int]:
        self.requests[prompt.id] += 1
        return prompt.id, max_tokens

    def acceptance_mark(self) -> int:
        return 0

    def acceptance_since(self, mark: int) -> AcceptanceStats:
        return AcceptanceStats(k=3)


PROMPT_SETS = {
    name: [EvalPrompt(id=f"{name}-{i}", prompt_set=name, messages=(("user", "hi"),)) for i in range(3)]
    for name in ("humaneval", "holdout")
}


@pytest.mark.parametrize(("concurrency", "requests_each"), [(1, 1), (4, 2)])
def test_each_prompt_is_sent_once_a_pass_and_at_concurrency_1_there_is_one_pass(concurrency, requests_each) -> None:
    server = CountingServer()
    results = measure_on_server(server, PROMPT_SETS, 8, concurrency, True, ignore_progress)  # type: ignore[arg-type]
    assert set(server.requests.values()) == {requests_each}
    for name, prompts in PROMPT_SETS.items():
        assert results[name]["outputs"] == [p.id for p in prompts]
        assert results[name]["batch1"]["tokens"] == results[name]["concurrent"]["tokens"] == 8 * len(prompts)
