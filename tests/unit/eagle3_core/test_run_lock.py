"""One run folder, one writer: a second process taking the run folder's lock is refused, naming the holder;
the holder's own descendants write under it; a slice of a run over hosts has a lock of its own; a refused or
unwritten command leaves no run folder; a killed holder's lock is free at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from eagle3_core.hosts import HostSlice
from eagle3_core.run_lock import RunDirBusy, lock_path, run_dir_lock
from tests.helpers.bad_input import run_dir_holder


def test_a_second_writer_is_refused_naming_the_holder_and_the_lock_frees_when_the_holder_dies(tmp_path):
    run_dir = tmp_path / "run"
    first = run_dir_holder(run_dir, ["eagle3", "run", "--config", "first.yaml"])
    try:
        with pytest.raises(RunDirBusy) as refused, run_dir_lock(run_dir):
            pass
        message = str(refused.value)
        assert message.startswith(f"run_dir {run_dir} is in use by pid {first.pid} on ")
        assert "`eagle3 run --config first.yaml`" in message
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    with run_dir_lock(run_dir):  # SIGKILL frees it: the kernel drops the dead holder's lock
        assert lock_path(run_dir).is_file()


def test_the_holders_own_process_and_children_write_under_its_lock(tmp_path):
    run_dir = tmp_path / "run"
    with run_dir_lock(run_dir, command=["eagle3", "run"]):
        with run_dir_lock(run_dir):  # the flow inside `eagle3 run`
            pass
        code = "import sys; from eagle3_core.run_lock import run_dir_lock\nwith run_dir_lock(sys.argv[1]): print('in')"
        child = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, check=False)
        assert child.stdout.strip() == "in", child.stderr


def test_slices_of_one_run_write_side_by_side_but_one_slice_has_one_writer(tmp_path):
    run_dir = tmp_path / "run"
    slice0 = run_dir_holder(run_dir, ["eagle3", "sample"], host=0)
    try:
        with run_dir_lock(run_dir, HostSlice(1, 2)), run_dir_lock(run_dir):
            pass  # host 1's slice and the parent flow each have their own lock
        with pytest.raises(RunDirBusy, match=f"in use by pid {slice0.pid} "), run_dir_lock(run_dir, HostSlice(0, 2)):
            pass
    finally:
        slice0.kill()
        slice0.wait()


def test_a_command_that_wrote_nothing_leaves_no_run_folder_and_a_run_folder_with_work_keeps_its_lock(tmp_path):
    run_dir = tmp_path / "new" / "run"
    with run_dir_lock(run_dir):
        assert run_dir.is_dir()
    assert not (tmp_path / "new").exists()
    with run_dir_lock(run_dir):
        (run_dir / "events.jsonl").write_text("")
    assert sorted(p.name for p in run_dir.iterdir()) == [".writer.lock", "events.jsonl"]


def test_a_file_or_an_unwritable_run_dir_is_one_clear_error(tmp_path):
    file = tmp_path / "run"
    file.write_text("not a folder")
    with pytest.raises(NotADirectoryError, match=f"run_dir {file} is a file"), run_dir_lock(file):
        pass
    if os.geteuid() == 0:
        pytest.skip("root writes any folder")
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o555)
    with pytest.raises(PermissionError, match=f"run_dir {read_only} is not writable"), run_dir_lock(read_only):
        pass
