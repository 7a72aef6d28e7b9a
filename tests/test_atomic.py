"""Atomic writes: the target holds the old or the new content, never part of one, and no temporary stays behind."""

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from titan_npu import atomic
from titan_npu.atomic import atomic_dir, atomic_path, atomic_write_bytes, atomic_write_json, atomic_write_text


class Midway(Exception):
    """What a writer raises after it has written part of its output."""


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def umask():
    """Run under a known umask (022), restored after."""
    old = os.umask(0o022)
    yield 0o022
    os.umask(old)


def test_written_text_bytes_and_json_land_under_the_name(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "héllo\n")
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01")
    atomic_write_json(tmp_path / "c.json", {"k": [1, 2]})
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "héllo\n"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert json.loads((tmp_path / "c.json").read_text()) == {"k": [1, 2]}
    assert names(tmp_path) == ["a.txt", "b.bin", "c.json"]


def test_a_write_that_raises_midway_leaves_the_old_content_and_no_temporary(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")
    with pytest.raises(Midway), atomic_path(target) as tmp:
        tmp.write_text("half of the n")
        raise Midway
    assert target.read_text() == "old"
    assert names(tmp_path) == ["f.txt"]


def test_a_failed_first_write_leaves_no_file(tmp_path):
    with pytest.raises(Midway), atomic_path(tmp_path / "f.txt") as tmp:
        tmp.write_text("half")
        raise Midway
    assert names(tmp_path) == []


def test_the_target_keeps_its_old_content_until_the_write_is_complete(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")
    with atomic_path(target) as tmp:
        tmp.write_text("new")
        assert target.read_text() == "old"
    assert target.read_text() == "new"


def test_the_temporary_is_a_hidden_unique_tmp_file_beside_the_target(tmp_path):
    target = tmp_path / "f.json"
    with atomic_path(target) as first, atomic_path(target) as second:
        for tmp in (first, second):
            assert tmp.parent == tmp_path and tmp.name.startswith(".f.json.") and tmp.name.endswith(".tmp")
            assert tmp.is_file() and tmp.stat().st_size == 0
        assert first != second  # two writers of one file (ranks, processes) never share a temporary
    assert names(tmp_path) == ["f.json"]


def test_a_new_file_gets_the_mode_the_umask_gives(tmp_path, umask):
    atomic_write_text(tmp_path / "f.txt", "x")
    assert stat.S_IMODE((tmp_path / "f.txt").stat().st_mode) == 0o666 & ~umask


def test_a_replaced_file_keeps_its_mode(tmp_path, umask):
    target = tmp_path / "f.txt"
    target.write_text("old")
    target.chmod(0o640)
    atomic_write_text(target, "new")
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


def test_a_file_its_writer_creates_private_still_gets_the_umask_mode(tmp_path, umask):
    with atomic_path(tmp_path / "f.bin") as tmp:  # as a library that writes a 0600 file and renames it over ours
        private = tmp_path / "private"
        private.write_bytes(b"x")
        private.chmod(0o600)
        os.replace(private, tmp)
    assert stat.S_IMODE((tmp_path / "f.bin").stat().st_mode) == 0o666 & ~umask


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="names fsync'd descriptors through /proc")
def test_the_file_is_flushed_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), replace(a, b)))
    target = tmp_path / "f.txt"
    with atomic_path(target) as tmp:
        tmp.write_text("new")
    assert events == [("fsync", str(tmp)), ("replace", str(target)), ("fsync", str(tmp_path))]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="names fsync'd descriptors through /proc")
def test_a_folders_files_are_flushed_before_it_takes_the_name(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), replace(a, b)))
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "w.bin").write_bytes(b"w")
    assert events == [("fsync", str(tmp)), ("fsync", str(tmp / "sub" / "w.bin")), ("fsync", str(tmp / "sub")),
                      ("replace", str(tmp_path / "out")), ("fsync", str(tmp_path))]


def test_writing_onto_a_folder_fails_and_leaves_it_and_no_temporary(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError):
        atomic_write_text(tmp_path / "d", "x")
    assert names(tmp_path) == ["d"] and names(tmp_path / "d") == []


def test_a_folder_lands_complete_under_its_name(tmp_path, umask):
    with atomic_dir(tmp_path / "out") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.") and tmp.name.endswith(".tmp")
        (tmp / "w.bin").write_bytes(b"w")
        assert not (tmp_path / "out").exists()
    assert names(tmp_path) == ["out"] and names(tmp_path / "out") == ["w.bin"]
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~umask


def test_a_folder_swap_keeps_the_old_folder_until_the_new_one_is_complete(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.bin").write_bytes(b"old")
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "new.bin").write_bytes(b"new")
        assert names(tmp_path / "out") == ["old.bin"]
    assert names(tmp_path) == ["out"] and names(tmp_path / "out") == ["new.bin"]


def test_a_folder_write_that_raises_midway_keeps_the_old_folder_and_leaves_no_temporary(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.bin").write_bytes(b"old")
    with pytest.raises(Midway), atomic_dir(tmp_path / "out") as tmp:
        (tmp / "new.bin").write_bytes(b"ne")
        raise Midway
    assert names(tmp_path) == ["out"] and (tmp_path / "out" / "old.bin").read_bytes() == b"old"


def test_a_failed_swap_puts_the_old_folder_back(tmp_path, monkeypatch):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.bin").write_bytes(b"old")
    replace = os.replace

    def fail_the_move_into_place(src, dst):
        if Path(src).name.endswith(".tmp"):
            raise OSError(5, "Input/output error")
        replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", fail_the_move_into_place)
    with pytest.raises(OSError, match="Input/output error"), atomic_dir(tmp_path / "out") as tmp:
        (tmp / "new.bin").write_bytes(b"new")
    assert names(tmp_path) == ["out"] and names(tmp_path / "out") == ["old.bin"]


def test_replace_dir_parks_the_old_folder_under_the_given_name_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    for name in ("new", "cur"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.bin").write_bytes(b"x")
    seen = []
    replace = os.replace
    monkeypatch.setattr(atomic.os, "replace", lambda a, b: (seen.append(names(tmp_path)), replace(a, b)))
    atomic.replace_dir(tmp_path / "new", tmp_path / "cur", tmp_path / ".cur.deleting")
    assert seen == [["cur", "new"], [".cur.deleting", "new"]]
    assert names(tmp_path) == ["cur"] and names(tmp_path / "cur") == ["new.bin"]


def test_the_helper_imports_only_the_standard_library():
    import subprocess

    code = ("import sys; before = set(sys.modules); import titan_npu.atomic; new = set(sys.modules) - before; "
            "print(sorted(m for m in new if m.split('.')[0] not in sys.stdlib_module_names))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout
    assert out.strip() == "['titan_npu', 'titan_npu.atomic']"  # any module may use it: no cycle, nothing heavy
