"""Measurement (b) in vLLM, the engine the draft will serve in (`served.measure_served` runs it).

The target is served twice in one run: with the exported draft (`--speculative-config` method eagle3, k
tokens) and without. Acceptance comes from vLLM's own `vllm:spec_decode_*` counters on `/metrics`, read
before and after each prompt set (the difference is that set's share), so the numbers are the engine's,
not ours. A departure from plain greedy is judged with the plain server's top-2 log-probabilities of the
OpenAI chat endpoint (`departures`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import httpx

from eagle3_core.evaluation.departures import TokenGap, top2_gap
from eagle3_core.evaluation.prompts import EvalPrompt
from eagle3_core.evaluation.served import PHASE, Measurement, measure_served
from eagle3_core.evaluation.stats import AcceptanceStats
from eagle3_core.serving.engine import VllmServer, speculative_args
from eagle3_core.serving.lifecycle import EngineServer

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
SAMPLE_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
LABEL = re.compile(r'(?P<key>\w+)="(?P<value>(?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line of Prometheus' text format; comments skipped."""
    samples = []
    for line in text.splitlines():
        match = SAMPLE_LINE.match(line.strip())
        if not match or line.startswith("#"):
            continue
        labels = {m["key"]: m["value"] for m in LABEL.finditer(match["labels"] or "")}
        samples.append((match["name"], labels, float(match["value"])))
    return samples


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's speculative-decoding counters, summed over engines (data-parallel ranks)."""

    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_position: tuple[float, ...]

    def minus(self, before: SpecCounters) -> SpecCounters:
        """Counts between two scrapes; positions missing from `before` count from zero."""
        earlier = list(before.accepted_per_position)
        earlier += [0.0] * (len(self.accepted_per_position) - len(earlier))
        return SpecCounters(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            tuple(a - b for a, b in zip(self.accepted_per_position, earlier, strict=True)),
        )

    def to_stats(self) -> AcceptanceStats:
        """As `AcceptanceStats`; vLLM's per-position counters must add up to its accepted total."""
        if round(sum(self.accepted_per_position)) != round(self.accepted):
            raise ValueError(
                f"vLLM per-position accepted counts {self.accepted_per_position} do not add up to {self.accepted}"
            )
        k = len(self.accepted_per_position)
        return AcceptanceStats(k, round(self.drafts), [round(a) for a in self.accepted_per_position])


def spec_counters(metrics_text: str) -> SpecCounters:
    """Read the `vllm:spec_decode_*` counters from a /metrics scrape; a server without a drafter has none
    and raises, naming the metric (a typo'd speculative config otherwise reads as zero acceptance)."""
    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for name, labels, value in parse_prometheus(metrics_text):
        if name == ACCEPTED_PER_POS:
            position = int(labels["position"])
            per_position[position] = per_position.get(position, 0.0) + value
        elif name in (DRAFTS, DRAFT_TOKENS, ACCEPTED):
            totals[name] = totals.get(name, 0.0) + value
    missing = [n for n in (DRAFTS, DRAFT_TOKENS, ACCEPTED) if n not in totals]
    if missing or not per_position:
        raise ValueError(f"/metrics has no speculative-decoding counters ({missing or ACCEPTED_PER_POS})")
    return SpecCounters(
        totals[DRAFTS],
        totals[DRAFT_TOKENS],
        totals[ACCEPTED],
        tuple(per_position.get(i, 0.0) for i in range(max(per_position) + 1)),
    )


class OpenAIClient:
    """The few calls evaluation makes to an OpenAI-compatible server."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def model_id(self) -> str:
        response = self.http.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]

    def metrics(self) -> str:
        response = self.http.get("/metrics")
        response.raise_for_status()
        return response.text

    def chat(self, model: str, prompt: EvalPrompt, max_tokens: int) -> tuple[str, int]:
        """Greedy chat completion -> (text, completion tokens)."""
        choice, usage = self.complete(model, prompt, max_tokens, {})
        return choice["message"].get("content") or "", int(usage["completion_tokens"])

    def acceptance_mark(self) -> SpecCounters:
        return spec_counters(self.metrics())

    def acceptance_since(self, mark: SpecCounters) -> AcceptanceStats:
        return spec_counters(self.metrics()).minus(mark).to_stats()

    def chat_top2(self, model: str, prompt: EvalPrompt, max_tokens: int) -> tuple[str, list[TokenGap]]:
        """Greedy chat completion with each generated token's bytes and top-2 log-probability gap."""
        choice, _ = self.complete(model, prompt, max_tokens, {"logprobs": True, "top_logprobs": 2})
        return choice["message"].get("content") or "", token_gaps(choice["logprobs"]["content"])

    def complete(
        self, model: str, prompt: EvalPrompt, max_tokens: int, extra: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        body = {
            "model": model,
            "messages": prompt.chat_messages(),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "seed": 0,
            **({"tools": prompt.tools(), "tool_choice": "none"} if prompt.tools() else {}),
            **extra,
        }
        response = self.http.post("/v1/chat/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"prompt {prompt.id}: HTTP {response.status_code}: {response.text[:500]}")
        data = response.json()
        return data["choices"][0], data["usage"]


def token_gaps(content: list[dict[str, Any]]) -> list[TokenGap]:
    """From the OpenAI `logprobs.content` list: each token's bytes (`bytes`, else its text) and top-2 gap
    (infinite when only one alternative came back)."""
    gaps = []
    for entry in content:
        raw = entry.get("bytes")
        token = bytes(raw) if raw is not None else entry["token"].encode()
        gaps.append(TokenGap(token, top2_gap([alt["logprob"] for alt in entry.get("top_logprobs") or []])))
    return gaps


def measure_vllm(measurement: Measurement) -> dict[str, Any]:
    """Measurement (b) in vLLM (`served.measure_served`): the draft as `--speculative-config` method eagle3."""
    m, config = measurement, measurement.config

    def serve(with_draft: bool) -> VllmServer:
        k = config.evaluation.num_speculative_tokens
        extra = speculative_args(m.draft_dir, k, config.server.extra_args) if with_draft else []
        return VllmServer(config.server, m.target_dir, config.run_dir, m.events, m.progress, extra, phase=PHASE)

    def connect(server: EngineServer) -> OpenAIClient:
        return OpenAIClient(server.base_url, server.api_key, config.sampling.request_timeout_s)

    return measure_served(measurement, "vllm", serve, connect)
