"""A run spread over `orchestration.hosts` hosts: which ids each host takes, where it writes, and the check
that the hosts' slices, merged, account for every id exactly once.

Host `i` of `N` takes the ids whose sha256 is `i` modulo `N` (`host_of`). The slice of an id depends on that
id and `N` alone: not on the other ids, their order or what is already done. So a re-run gives every host
the same slice (its shards resume where they stopped, none is rewritten), and the nightly run's new prompts
move no old prompt to another host, which positions in the sorted ids (modulo N, or contiguous ranges) would
do. Slices of a large set are balanced to within a few percent (the hash is uniform); a tiny set may leave
a host with fewer ids, or none. Each slice writes a folder of its own (`host-<i>-of-<N>` under the phase's),
so no two hosts ever write one file; another `N` is another set of folders.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from eagle3_core.config import PipelineConfig

EXAMPLES = 5  # ids named in an accounting error, of each kind
SLICE_SUFFIX = re.compile(r"-host-(?P<host>\d+)-of-(?P<hosts>\d+)$")


class SlicesMismatch(RuntimeError):
    """The merged slices do not hold every id exactly once; the message names the ids."""


def host_of(item_id: str, hosts: int) -> int:
    """The host (0..hosts-1) that takes `item_id`: its sha256 modulo `hosts` (the digest's last 8 bytes;
    the held-out split reads the first 8, so the two are independent)."""
    return int.from_bytes(hashlib.sha256(item_id.encode()).digest()[-8:], "big") % hosts


@dataclass(frozen=True)
class HostSlice:
    """Host `host` of `hosts`: the ids it takes and the folder it writes under a phase's folder."""

    host: int
    hosts: int

    def __post_init__(self) -> None:
        if not 0 <= self.host < self.hosts:
            raise ValueError(f"host {self.host} is not one of the {self.hosts} hosts")

    @property
    def name(self) -> str:
        return f"host-{self.host}-of-{self.hosts}"

    def takes(self, item_id: str) -> bool:
        return host_of(item_id, self.hosts) == self.host

    def folder(self, phase_dir: Path) -> Path:
        return phase_dir / self.name


def host_slice(config: PipelineConfig) -> HostSlice | None:
    """The slice this process works on (`orchestration.host` of `hosts`), None for every id."""
    orchestration = config.orchestration
    return None if orchestration.host is None else HostSlice(orchestration.host, orchestration.hosts)


def slice_named(name: str) -> HostSlice | None:
    """The slice a file name's stem ends with (`training-host-1-of-2` -> host 1 of 2), None if it names none."""
    match = SLICE_SUFFIX.search(name)
    if match is None or int(match["host"]) >= int(match["hosts"]):
        return None
    return HostSlice(int(match["host"]), int(match["hosts"]))


def in_slice(part: HostSlice | None, item_id: str) -> bool:
    """Whether `item_id` is for this process to work on: every id without a slice."""
    return part is None or part.takes(item_id)


def every_slice(hosts: int) -> list[HostSlice]:
    return [HostSlice(host, hosts) for host in range(hosts)]


def unaccounted(wanted: Iterable[str], found: Iterable[str]) -> dict[str, list[str]]:
    """The ids `found` gets wrong against `wanted`: missing, unknown (not wanted) and repeated, sorted;
    empty lists when every wanted id is found exactly once."""
    expected = set(wanted)
    counts = Counter(found)
    return {
        "missing": sorted(expected - counts.keys()),
        "unknown": sorted(counts.keys() - expected),
        "repeated": sorted(i for i, n in counts.items() if n > 1),
    }


def check_each_once(wanted: Iterable[str], found: Iterable[str], where: str) -> None:
    """Raise `SlicesMismatch` naming the ids (a few of each kind) unless `found` holds every `wanted` id once."""
    wrong = {kind: ids for kind, ids in unaccounted(wanted, found).items() if ids}
    if wrong:
        named = "; ".join(f"{len(ids)} {kind} (e.g. {ids[:EXAMPLES]})" for kind, ids in wrong.items())
        raise SlicesMismatch(f"{where} do not account for every id exactly once: {named}")
