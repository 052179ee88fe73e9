"""runs_dir shared by several hosts (tasks/on_disk/shared_storage.py): the probe `setup` runs on a real folder, and
the mount options that keep file locks on one host."""

from __future__ import annotations

from pathlib import Path

from tasks.on_disk.shared_storage import check_shared_storage, mount_of

MOUNTS = """/dev/sda1 / ext4 rw,relatime 0 0
server:/export /data nfs rw,vers=3,nolock,proto=tcp 0 0
server:/export4 /data/v4 nfs4 rw,vers=4.2,local_lock=none 0 0
"""


def test_a_local_folder_renames_atomically_and_locks_between_processes(tmp_path: Path) -> None:
    checked, problems = check_shared_storage(tmp_path / "runs")
    assert problems == []
    assert checked[:2] == ["atomic rename", "a file lock another process sees"], checked
    assert not [p for p in (tmp_path / "runs").iterdir()]  # the probe leaves nothing behind


def test_nfs_with_local_locks_is_refused_and_a_file_as_runs_dir_says_so(tmp_path: Path) -> None:
    assert mount_of(Path("/data/runs"), MOUNTS) == ("nfs", ["rw", "vers=3", "nolock", "proto=tcp"])
    assert mount_of(Path("/data/v4/runs"), MOUNTS)[0] == "nfs4"
    assert mount_of(Path("/database"), MOUNTS)[0] == "ext4"  # a prefix of a name is not a mount point above it
    # the probe runs on a real folder; the mount table says where it would be mounted
    mounts = f"/dev/sda1 / ext4 rw 0 0\nserver:/x {tmp_path} nfs rw,vers=3,nolock 0 0\n"
    _, problems = check_shared_storage(tmp_path / "runs", mounts=mounts)
    assert len(problems) == 1 and "mounted with nolock: file locks stay on the host" in problems[0], problems
    assert check_shared_storage(tmp_path / "runs", mounts=mounts.replace("nolock", "local_lock=none"))[1] == []
    (tmp_path / "file").write_text("")
    _, problems = check_shared_storage(tmp_path / "file")
    assert len(problems) == 1 and "is a file" in problems[0], problems
