"""Slices of a run spread over hosts (eagle3_core/hosts.py): stable, a partition, independent of the other ids
and of what is done; the exactly-once check names the ids it finds wrong; the layout gives each slice its
own folders."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from eagle3_core.config import ConfigError, PipelineConfig, load_config
from eagle3_core.hosts import HostSlice, SlicesMismatch, check_each_once, every_slice, host_of, host_slice
from eagle3_core.run_layout import RunLayout

IDS = [f"prompt-{i:05d}" for i in range(2000)]


def test_every_id_has_exactly_one_host_and_slices_are_balanced():
    for hosts in (1, 2, 3, 4):
        takers = [[part.host for part in every_slice(hosts) if part.takes(i)] for i in IDS]
        assert all(len(t) == 1 for t in takers)
        sizes = Counter(t[0] for t in takers)
        assert sorted(sizes) == list(range(hosts))
        assert max(sizes.values()) - min(sizes.values()) < 0.15 * len(IDS) / hosts, sizes


def test_an_ids_host_depends_on_the_id_alone():
    before = {i: host_of(i, 4) for i in IDS}
    grown = [f"new-{i}" for i in range(500)] + list(reversed(IDS))  # the nightly run's new prompts, reordered
    assert {i: host_of(i, 4) for i in grown if i in before} == before
    assert host_of("prompt-00001", 4) == 3  # fixed by the hash: the same on every host and every re-run


def test_the_slice_is_independent_of_the_held_out_split():
    from eagle3_core.sampling.table import is_heldout

    held = [i for i in IDS if is_heldout(i, 0.25)]
    shares = Counter(host_of(i, 2) for i in held)
    assert abs(shares[0] - shares[1]) < 0.15 * len(held)


def test_check_each_once_names_missing_unknown_and_repeated_ids():
    check_each_once(["a", "b"], ["b", "a"], "x")
    with pytest.raises(SlicesMismatch) as failure:
        check_each_once(["a", "b", "c"], ["a", "a", "d"], "samples at /run/samples")
    message = str(failure.value)
    assert message.startswith("samples at /run/samples do not account for every id exactly once")
    assert "2 missing (e.g. ['b', 'c'])" in message
    assert "1 unknown (e.g. ['d'])" in message and "1 repeated (e.g. ['a'])" in message


def test_host_is_one_of_hosts():
    config = load_config(overrides=["orchestration.hosts=2", "orchestration.host=1"])
    assert host_slice(config) == HostSlice(1, 2) and host_slice(PipelineConfig()) is None
    with pytest.raises(ConfigError, match="host 2 is not one of the 2 hosts"):
        load_config(overrides=["orchestration.hosts=2", "orchestration.host=2"])
    with pytest.raises(ValueError):
        HostSlice(-1, 2)


def test_a_slice_writes_folders_of_its_own_and_shares_the_rest(tmp_path: Path):
    whole = RunLayout.of(PipelineConfig(run_dir=tmp_path))
    config = PipelineConfig(run_dir=tmp_path, orchestration={"hosts": 2, "host": 1})
    part = RunLayout.of(config)
    assert part.samples == whole.samples / "host-1-of-2"
    assert part.hidden_states == whole.hidden_states / "host-1-of-2"
    assert part.incoming_states == part.hidden_states / "incoming"
    assert (part.draft, part.vocab, part.server) == (whole.draft, whole.vocab, whole.server)
    # the hosts share server/: a node's training agent has a pid file of its own there
    assert part.pid_file("training") == whole.server / "training-host-1-of-2.pid" != whole.pid_file("training")
