"""tiers.lockfile: the lock behind swap directories and checkpoint saves ([Note: lock files])."""
import os

import pytest

from tiers import lockfile


def test_a_second_taker_is_refused_naming_the_holder(tmp_path):
    path = str(tmp_path / ".lock")
    fd = lockfile.take(path, "pid 1 run first")
    with pytest.raises(lockfile.LockBusy) as busy:
        lockfile.take(path, "pid 2 run second")   # a second open file description: flock refuses it
    assert busy.value.holder == "pid 1 run first" and busy.value.path == path
    assert open(path).read() == "pid 1 run first\n"
    lockfile.release(path, fd)
    assert not os.path.exists(path)


def test_a_file_left_by_a_dead_holder_is_taken_and_restamped(tmp_path):
    path = str(tmp_path / ".lock")
    with open(path, "w") as f:
        f.write("pid 99999 run crashed, a much longer stamp than the next one\n")
    fd = lockfile.take(path, "pid 3 run new")
    assert open(path).read() == "pid 3 run new\n"
    lockfile.release(path, fd)


def test_release_leaves_a_file_that_replaced_the_locked_one(tmp_path):
    path = str(tmp_path / ".lock")
    fd = lockfile.take(path, "pid 1 run first")
    os.unlink(path)
    other = lockfile.take(path, "pid 2 run second")   # a new inode at the path: free to lock
    lockfile.release(path, fd)                         # not the file fd holds: left alone
    assert open(path).read() == "pid 2 run second\n"
    with pytest.raises(lockfile.LockBusy):
        lockfile.take(path, "pid 3 run third")
    lockfile.release(path, other)
    assert not os.path.exists(path)


def test_an_unwritable_directory_is_an_os_error_and_locks_nothing(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(PermissionError):
            lockfile.take(str(tmp_path / ".lock"), "pid 1")
    finally:
        tmp_path.chmod(0o700)
