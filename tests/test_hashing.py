"""Content hashes (README: Integrity): parallel hashing gives the same sha256, fingerprints and cache keys as reading
one file after another, and input hashes are memoised per file identity across processes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tasks.config import load_config
from tasks.hashing import files as file_hashes
from tasks.hashing.files import INPUT_HASH_MEMO, file_sha256, files_fingerprint, files_sha256, prefetch_sha256
from tasks.models.sources import TOKENIZER_FILES
from tasks.on_disk.folders import StageSpec
from tasks.prepare_data.parts import part_key
from tasks.prepare_data.stage import spec as data_spec
from tasks.prepare_data.tokenization import Settings
from tasks.prepare_model.stage import prefetch_fingerprint
from tasks.prepare_model.stage import spec as model_spec
from tests.conftest import settled


def _reference_sha256(path: Path) -> str:
    """sha256 as hashed before parallel hashing: the whole file, one thread."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _reference_fingerprint(paths: list[Path], root: Path | None = None) -> str:
    entries = sorted((str(p.relative_to(root)) if root else p.name, _reference_sha256(p)) for p in paths)
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several hashing threads whatever the load average (without it a busy test machine may get one)."""
    monkeypatch.setenv("QLORA_CPU_THREADS", "3")


def test_parallel_hashes_equal_a_sequential_reference(tmp_path: Path, threads: None) -> None:
    # empty, one byte, one read (16 MiB) and a byte past it, and a few MiB of odd length
    sizes = {"empty": 0, "one": 1, "block": 16 << 20, "past": (16 << 20) + 1, "odd": 3_000_001}
    paths = []
    for name, size in sizes.items():
        (tmp_path / "sub").mkdir(exist_ok=True)
        path = tmp_path / ("sub" if name == "odd" else "") / name
        path.write_bytes(os.urandom(size))
        paths.append(path)
    assert files_sha256(paths) == {p: _reference_sha256(p) for p in paths}
    assert files_fingerprint(paths, root=tmp_path) == _reference_fingerprint(paths, root=tmp_path)
    assert files_fingerprint(paths, runs_dir=tmp_path / "runs") == _reference_fingerprint(paths)
    assert file_sha256(paths[1], tmp_path / "runs") == _reference_sha256(paths[1])


def test_default_config_keys_equal_those_of_a_sequential_reference(tmp_path: Path, threads: None) -> None:
    config = load_config(None, [])
    model_folder, data_file = Path(config.model.base_model), Path(config.data.source)
    model = model_spec(config.model, tmp_path)
    reference = {"files_sha256": _reference_fingerprint([p for p in model_folder.iterdir() if p.is_file()])}
    assert model.fingerprint == reference
    assert model.key == dataclasses.replace(model, fingerprint=reference).key
    data = data_spec(config.data, config.model, tmp_path)
    tokenizer = [p for p in model_folder.iterdir() if p.is_file() and p.name in TOKENIZER_FILES]
    reference = {"data": _reference_sha256(data_file), "tokenizer_files_sha256": _reference_fingerprint(tokenizer)}
    assert data.fingerprint == reference
    assert data.key == dataclasses.replace(data, fingerprint=reference).key


def _fingerprint_in_a_new_process(paths: list[Path], runs_dir: Path) -> str:
    code = ("import sys; from pathlib import Path; from tasks.hashing.files import files_fingerprint; "
            "print(files_fingerprint([Path(p) for p in sys.argv[2:]], runs_dir=Path(sys.argv[1])))")
    done = subprocess.run([sys.executable, "-c", code, str(runs_dir), *map(str, paths)], capture_output=True,
                          text=True, check=True)
    return done.stdout.strip()


def test_input_hashes_are_memoised_per_identity_across_processes(tmp_path: Path, threads: None) -> None:
    runs = tmp_path / "runs"
    paths = [tmp_path / "a.bin", tmp_path / "b.bin"]
    for path in paths:
        path.write_bytes(os.urandom(1 << 20))
    settled(*paths)
    original = files_fingerprint(paths, runs_dir=runs)
    memo = json.loads((runs / INPUT_HASH_MEMO).read_text())
    for path in paths:
        st = path.stat()
        assert memo[str(path.resolve())] == [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev,
                                             _reference_sha256(path)]
    # another process trusts the memo while the identity holds (no read): a wrong digest there is believed
    wrong = {**memo, str(paths[0].resolve()): [*memo[str(paths[0].resolve())][:5], "0" * 64]}
    (runs / INPUT_HASH_MEMO).write_text(json.dumps(wrong))
    assert _fingerprint_in_a_new_process(paths, runs) != original
    (runs / INPUT_HASH_MEMO).write_text(json.dumps(memo))
    assert _fingerprint_in_a_new_process(paths, runs) == original

    # edited in place as `cp -p` or `touch -d` leave a file: same inode, same size, the very same mtime_ns
    before = paths[0].stat()
    with paths[0].open("r+b") as f:
        f.write(b"edited")
    os.utime(paths[0], ns=(before.st_atime_ns, before.st_mtime_ns))
    after = paths[0].stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    edited = _reference_fingerprint(paths)
    assert edited != original
    assert _fingerprint_in_a_new_process(paths, runs) == edited  # the memo file: its entry's ctime no longer holds
    assert files_fingerprint(paths, runs_dir=runs) == edited  # this process: its memo is by identity too
    settled(paths[0])
    files_fingerprint(paths, runs_dir=runs)
    assert json.loads((runs / INPUT_HASH_MEMO).read_text())[str(paths[0].resolve())][5] == _reference_sha256(paths[0])


def test_a_file_changed_just_before_its_read_is_not_memoised(tmp_path: Path, threads: None) -> None:
    """Within one timestamp tick a write can leave ctime as it was: a file that changed that recently is hashed
    again by the next look, in this process and in others, until it has settled."""
    runs, path = tmp_path / "runs", tmp_path / "fresh.bin"
    path.write_bytes(os.urandom(1 << 16))
    assert file_sha256(path, runs) == _reference_sha256(path)
    assert not (runs / INPUT_HASH_MEMO).exists()  # nothing memoised: the file changed less than a tick ago
    assert not any(identity[0] == str(path.resolve()) for identity in file_hashes._FILE_HASH_CACHE)
    settled(path)
    file_sha256(path, runs)
    assert json.loads((runs / INPUT_HASH_MEMO).read_text())[str(path.resolve())][5] == _reference_sha256(path)


def test_files_on_a_filesystem_without_a_kept_ctime_are_hashed_on_every_run(tmp_path: Path, threads: None,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The mount table says which filesystem holds a file; under a FUSE mount (here: this folder, as the mount table
    of a machine where it is an rclone mount would list it) the memo file is neither read nor written."""
    runs, data = tmp_path / "runs", tmp_path / "mnt" / "data"
    data.mkdir(parents=True)
    path = data / "shard.jsonl"
    path.write_bytes(os.urandom(1 << 16))
    settled(path)
    digest = file_sha256(path, runs)
    memo = json.loads((runs / INPUT_HASH_MEMO).read_text())
    assert memo[str(path.resolve())][5] == digest  # ext4, tmpfs: memoised
    forged = {str(path.resolve()): [*memo[str(path.resolve())][:5], "0" * 64]}
    (runs / INPUT_HASH_MEMO).write_text(json.dumps(forged))
    mountinfo = tmp_path / "mountinfo"
    point = str((tmp_path / "mnt").resolve()).replace(" ", "\\040")
    mountinfo.write_text(Path("/proc/self/mountinfo").read_text()
                         + f"999 1 0:99 / {point} rw,nosuid - fuse.rclone remote: rw,user_id=0\n")
    code = ("import sys; from pathlib import Path; import tasks.hashing.files as m; m._MOUNTINFO = Path(sys.argv[1]); "
            "print(m.file_sha256(Path(sys.argv[2]), Path(sys.argv[3])))")
    done = subprocess.run([sys.executable, "-c", code, str(mountinfo), str(path), str(runs)], capture_output=True,
                          text=True, check=True)
    assert done.stdout.strip() == _reference_sha256(path)  # read, not the memo's forged digest
    assert json.loads((runs / INPUT_HASH_MEMO).read_text()) == forged  # and nothing written for it
    monkeypatch.setattr(file_hashes, "_MOUNTINFO", mountinfo)
    assert file_hashes._mount_of(str(path.resolve()), file_hashes._mounts()) == (str((tmp_path / "mnt").resolve()),
                                                                                "fuse.rclone")


def test_an_unchanged_base_model_is_read_once_per_runs_dir(tmp_path: Path, threads: None) -> None:
    """The memo of an unchanged base model is kept in runs_dir: a new process's spec is a stat per file."""
    config = load_config(None, [])
    key = model_spec(config.model, tmp_path).key
    memo = json.loads((tmp_path / INPUT_HASH_MEMO).read_text())
    files = [p for p in Path(config.model.base_model).iterdir() if p.is_file()]
    assert {str(p.resolve()) for p in files} <= set(memo)
    # a wrong digest in the memo is believed by a new process: proof that it read none of the files
    forged = {name: [*entry[:5], "0" * 64] for name, entry in memo.items()}
    (tmp_path / INPUT_HASH_MEMO).write_text(json.dumps(forged))
    assert _fingerprint_in_a_new_process(files, tmp_path) == hashlib.sha256(json.dumps(
        sorted((p.name, "0" * 64) for p in files)).encode()).hexdigest()
    (tmp_path / INPUT_HASH_MEMO).write_text(json.dumps(memo))
    assert model_spec(config.model, tmp_path).key == key


def _reads(monkeypatch: pytest.MonkeyPatch, hold: Path | None = None, fail_once: bool = False
           ) -> tuple[list[Path], threading.Event]:
    """Record every file read for a hash; reads of `hold` wait for the event (so a second caller finds the hash in
    flight), and with `fail_once` the first read of it raises after the wait."""
    reads, release, real = [], threading.Event(), file_hashes._sha256

    def read(path: Path) -> str:
        reads.append(path)
        if path == hold:
            release.wait(timeout=30)
            if fail_once and reads.count(path) == 1:
                raise OSError(f"{path}: a read that failed")
        return real(path)

    monkeypatch.setattr(file_hashes, "_sha256", read)
    return reads, release


def _in_thread(paths: list[Path], reads: list[Path]) -> tuple[threading.Thread, dict[str, Any]]:
    """files_sha256 of `paths` on a thread of its own, started once the prefetch is reading (`reads`)."""
    deadline = time.monotonic() + 30
    while not reads and time.monotonic() < deadline:
        time.sleep(0.01)
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(hashes=files_sha256(paths)))
    thread.start()
    return thread, result


def test_a_hash_in_flight_is_waited_for_not_read_twice(tmp_path: Path, threads: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [tmp_path / "weights.bin", tmp_path / "config.json"]
    paths[0].write_bytes(os.urandom(3 << 20))
    paths[1].write_text("{}")
    settled(*paths)
    reads, release = _reads(monkeypatch, hold=paths[0])
    prefetch = prefetch_sha256(paths, tmp_path / "runs")
    waiter, result = _in_thread(paths[:1], reads)
    waiter.join(timeout=0.5)
    assert waiter.is_alive()  # the prefetch holds the file's read: the stage's call waits for it
    release.set()
    waiter.join(timeout=30)
    prefetch.join(timeout=30)
    assert result["hashes"] == {paths[0]: _reference_sha256(paths[0])}
    assert sorted(reads) == sorted(paths)  # each file read once, by the prefetch
    memo = json.loads((tmp_path / "runs" / INPUT_HASH_MEMO).read_text())
    assert {memo[str(p.resolve())][5] for p in paths} == {_reference_sha256(p) for p in paths}


def test_a_failed_read_in_flight_is_read_again_by_the_waiter(tmp_path: Path, threads: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(1 << 20))
    reads, release = _reads(monkeypatch, hold=path, fail_once=True)
    prefetch = prefetch_sha256([path])
    waiter, result = _in_thread([path], reads)
    waiter.join(timeout=0.5)
    release.set()
    waiter.join(timeout=30)
    prefetch.join(timeout=30)
    assert not prefetch.is_alive() and not waiter.is_alive()
    assert result["hashes"] == {path: _reference_sha256(path)}  # the prefetch's failure did not reach the stage
    assert reads == [path, path]


def test_the_flow_prefetches_the_base_models_weights_not_its_tokenizer(tmp_path: Path, threads: None) -> None:
    config = load_config(None, [])
    files = [p for p in Path(config.model.base_model).iterdir() if p.is_file()]
    prefetch_fingerprint(config.model, tmp_path).join(timeout=60)
    memo = json.loads((tmp_path / INPUT_HASH_MEMO).read_text())
    assert set(memo) == {str(p.resolve()) for p in files if p.name not in TOKENIZER_FILES}
    reference = {"files_sha256": _reference_fingerprint(files)}
    assert model_spec(config.model, tmp_path).fingerprint == reference
    assert prefetch_fingerprint(config.model.model_copy(update={"base_model": str(tmp_path / "none")}),
                                tmp_path) is None


def test_keys_of_fixed_inputs_stay_what_they_were() -> None:
    """A stage key and a prepare_data part key of fixed inputs, pinned: a change of how keys are made
    (tasks/hashing/keys.py cache_key) would recompute every user's stage folders and parts."""
    spec = StageSpec(stage="prepare_data", version="2", runs_dir=Path("/tmp/x"),
                     params={"data": {"source": "a.jsonl", "eval_fraction": 0.1}}, fingerprint={"data": "f" * 64},
                     located=("data.source",))
    assert spec.key == "f54ec97519c2276c"
    settings = Settings(tokenizer_dir="/anywhere", fmt="instruction", column_mapping={}, completion_only=True,
                        max_len=512, chat_template=None, prefix=[1], eos=[2], eos_text="</s>", backend_json=None)
    assert part_key("a" * 64, settings, {"tokenizer_files_sha256": "b" * 64}, "2") == "264340dd4e3013b3"
