"""Acceptance statistics shared by both measurements: counts of verification steps ("drafts") and of
accepted draft tokens per position, as vLLM's `vllm:spec_decode_*` counters keep them.

Acceptance in greedy chain drafting is a prefix: position i is accepted only if positions 0..i-1 were.
So `accepted[i]` counts the steps whose first i+1 draft tokens were all accepted, `accepted[i] / drafts`
is vLLM's per-position rate, and the acceptance length (tokens emitted per target step, the bonus token
included) is `tau = 1 + sum(accepted) / drafts`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    k: int  # draft tokens proposed per step
    drafts: int = 0  # target verification steps that checked a draft
    accepted: list[int] = field(default_factory=list)  # [k] steps whose first i+1 tokens were accepted

    def __post_init__(self) -> None:
        if not self.accepted:
            self.accepted = [0] * self.k
        if len(self.accepted) != self.k:
            raise ValueError(f"accepted has {len(self.accepted)} positions, k is {self.k}")

    def add_step(self, num_accepted: int) -> None:
        """Count one verification step in which the first `num_accepted` draft tokens were accepted."""
        if not 0 <= num_accepted <= self.k:
            raise ValueError(f"{num_accepted} accepted tokens with k={self.k}")
        self.drafts += 1
        for position in range(num_accepted):
            self.accepted[position] += 1

    @classmethod
    def from_histogram(cls, k: int, histogram: list[int]) -> AcceptanceStats:
        """From verification steps counted by accepted draft tokens (SGLang's `spec_correct_drafts_histogram`:
        entry a counts the steps that accepted exactly a tokens, so positions 0..a-1)."""
        if any(histogram[k + 1 :]):
            raise ValueError(f"acceptance histogram {histogram} has steps accepting more than k={k} tokens")
        return cls(k, sum(histogram), [sum(histogram[i + 1 :]) for i in range(k)])

    def merge(self, other: AcceptanceStats) -> AcceptanceStats:
        if other.k != self.k:
            raise ValueError(f"cannot merge statistics of k={self.k} and k={other.k}")
        return AcceptanceStats(
            self.k,
            self.drafts + other.drafts,
            [a + b for a, b in zip(self.accepted, other.accepted, strict=True)],
        )

    @property
    def per_position(self) -> list[float]:
        """Share of steps whose draft was accepted up to and including position i."""
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted]

    @property
    def acceptance_length(self) -> float:
        return 1.0 + sum(self.accepted) / self.drafts if self.drafts else 1.0

    def tau_for_k(self, k: int) -> float:
        """Acceptance length a run with k <= self.k draft tokens per step would reach, from this run.

        In greedy chain drafting the draft's first j proposals do not depend on how many more it is asked
        for, and verification accepts a prefix, so a step with k tokens accepts min(a, k) of them where a
        is what the same step accepts with more. Hence `tau(k) = 1 + sum_{i<k} P(first i+1 accepted)`,
        the prefix of this run's per-position rates. The one approximation: with a smaller k the steps
        start at other places in the text (after shorter accepted runs); the estimate assumes acceptance
        does not depend on where a step starts. The vLLM measurement, run at the configured k itself, is
        the check on it.
        """
        if not 1 <= k <= self.k:
            raise ValueError(f"tau for k={k} cannot be derived from a run with k={self.k}")
        return 1.0 + sum(self.per_position[:k])

    def tau_by_k(self) -> list[float]:
        """`tau_for_k(j)` for j = 1..k."""
        return [self.tau_for_k(j) for j in range(1, self.k + 1)]

    def truncated(self, k: int) -> AcceptanceStats:
        """The counts a k-token run is estimated to have seen (see `tau_for_k`)."""
        self.tau_for_k(k)
        return AcceptanceStats(k, self.drafts, list(self.accepted[:k]))

    def to_json(self) -> dict:
        return {
            "k": self.k,
            "drafts": self.drafts,
            "accepted": list(self.accepted),
            "per_position": self.per_position,
            "acceptance_length": self.acceptance_length,
        }

    @classmethod
    def from_json(cls, data: dict) -> AcceptanceStats:
        return cls(int(data["k"]), int(data["drafts"]), [int(a) for a in data["accepted"]])
