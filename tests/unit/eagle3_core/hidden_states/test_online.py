"""The online dataset: the same items as a stored set of the same states, asked for in the order training's
plan decides and never more than `prefetch` samples ahead, from the resume step on, and once per epoch
without a cache."""

from __future__ import annotations

import threading

import pytest
import torch

from eagle3_core.hidden_states.description import StatesDescription
from eagle3_core.hidden_states.online import OnlineDataset, OnlineStates
from eagle3_core.hidden_states.reader import HiddenStateDataset
from eagle3_core.hidden_states.storage import SampleStates, ShardError
from eagle3_core.training.batches import step_batches
from eagle3_core.training.distributed import Group
from tests.helpers.hidden_state_sets import H, make_set, states

LENGTHS = [5, 9, 3, 7, 4, 6, 8, 2, 5, 7]
SOLO = Group(0, 1, torch.device("cpu"))


class RecordingEngine:
    """A StatesSource answering with `hidden_state_sets.states` (the very values `make_set` stores), recording
    the ids asked for and the most samples asked for and not yet read by the dataset."""

    def __init__(self, lengths: list[int]):
        self.by_id = {f"s{i}": states(f"s{i}", n, 100.0 * i) for i, n in enumerate(lengths)}
        self.asked: list[str] = []
        self.lock = threading.Lock()

    def extract(self, rows: list[dict]) -> tuple[list[SampleStates], None]:
        with self.lock:
            self.asked += [row["id"] for row in rows]
        return [self.by_id[row["id"]] for row in rows], None


def rows_of(lengths: list[int]) -> list[dict]:
    engine = RecordingEngine(lengths)
    return [
        {
            "id": s.sample_id,
            "prompt_id": s.sample_id,
            "input_ids": s.input_ids.tolist(),
            "loss_mask": [1] * len(s.input_ids),
        }
        for s in (engine.by_id[f"s{i}"] for i in range(len(lengths)))
    ]


def online(engine: RecordingEngine, prefetch: int = 4, cache_bytes: int = 0, dtype: str = "bf16") -> OnlineStates:
    description = StatesDescription((2, 4, 5), dtype, H)
    return OnlineStates(engine, rows_of(LENGTHS), description, "sample-set", "key", prefetch, cache_bytes)


def plan_of(data, start: int, stop: int, batch_size: int = 2, seed: int = 3):
    steps_per_epoch = -(-len(data) // batch_size)
    return step_batches(len(data), batch_size, SOLO, seed, steps_per_epoch, start, stop)


def asked_order(data, plan: list[list[int]]) -> list[str]:
    return [data.rows[i].get("id") for step in plan for item in step for i in data.packs[item]]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_items_equal_the_stored_sets_items(tmp_path, dtype) -> None:
    stored = HiddenStateDataset(make_set(tmp_path, LENGTHS, dtype), 12, dequantize=False)
    live = OnlineDataset(online(RecordingEngine(LENGTHS), dtype=dtype), 12)
    assert live.packs == stored.packs and live.sample_ids == stored.sample_ids and live.truncated == stored.truncated
    for index in range(len(stored)):
        mine, theirs = live[index], stored[index]
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[name], theirs[name]) for name in theirs)


def test_follow_asks_in_the_plans_order_and_a_bounded_number_ahead() -> None:
    engine = RecordingEngine(LENGTHS)
    data = OnlineDataset(online(engine, prefetch=3), 12)
    plan = list(plan_of(data, 0, 8))
    most_ahead, handed = 0, []
    for indices in data.follow(iter(plan)):
        read = sum(len(data.packs[i]) for step in [*handed, indices] for i in step)
        most_ahead = max(most_ahead, len(engine.asked) - read)
        assert all(data[i] is not None for i in indices)  # read as the training loop reads them
        handed.append(indices)
    assert handed == plan
    assert engine.asked == asked_order(data, plan)
    step_samples = max(sum(len(data.packs[i]) for i in step) for step in plan)
    assert most_ahead <= 3 + step_samples  # the bound, plus the step asked for while the queue was short
    assert not data._ready  # every item fetched ahead was read, and dropped


def test_a_resumed_plan_asks_from_the_saved_step_on() -> None:
    engine = RecordingEngine(LENGTHS)
    data = OnlineDataset(online(engine), 12)
    full = list(plan_of(data, 0, 9))
    for indices in data.follow(plan_of(data, 5, 9)):
        [data[i] for i in indices]
    assert engine.asked == asked_order(data, full[5:])


def test_every_epoch_asks_again_unless_the_cache_keeps_the_states() -> None:
    for cache_bytes, epochs_asked in ((0, 3), (10**9, 1)):
        engine = RecordingEngine(LENGTHS)
        data = OnlineDataset(online(engine, cache_bytes=cache_bytes), 12)
        steps = 3 * (-(-len(data) // 2))
        for indices in data.follow(plan_of(data, 0, steps)):
            [data[i] for i in indices]
        assert len(engine.asked) == epochs_asked * len(LENGTHS)


def test_states_that_do_not_match_their_row_are_refused() -> None:
    engine = RecordingEngine(LENGTHS)
    engine.by_id["s1"].input_ids[0] += 1
    data = OnlineDataset(online(engine), 12)
    with pytest.raises(ShardError, match="sample s1: token ids differ"):
        [data[i] for i in range(len(data))]
