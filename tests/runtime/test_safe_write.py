"""Atomic writes inside a directory that never follow a symbolic link out of it."""
from __future__ import annotations

import pytest

from tessel.runtime.safe_write import FileReadError, FileWriteError, check_writable, read_text, write_file, write_npz, write_text


@pytest.fixture
def tree(tmp_path):
    """root/reports/ with a file, a link to a file outside root, and a link to a directory outside root."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "reports").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    (root / "reports" / "plain.md").write_text("old")
    (root / "reports" / "linked.md").symlink_to(outside / "secret.txt")
    (root / "elsewhere").symlink_to(outside)
    return root, outside


def _listing(directory):
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def test_replaces_a_plain_file_and_leaves_no_temporary(tree):
    root, _ = tree
    before = _listing(root)
    assert write_text(root, "reports/plain.md", "new") == root / "reports" / "plain.md"
    assert (root / "reports" / "plain.md").read_text() == "new" and _listing(root) == before


@pytest.mark.parametrize("relative, message", [
    ("reports/linked.md", "reports/linked.md: is a symbolic link"),
    ("elsewhere/new.txt", "elsewhere is a symbolic link"),
    ("elsewhere/secret.txt", "elsewhere is a symbolic link"),
    ("../outside/secret.txt", "not a plain relative path"),
    ("/etc/passwd", "not a plain relative path"),
])
def test_never_writes_through_a_link_or_out_of_the_directory(tree, relative, message):
    root, outside = tree
    before = _listing(outside)
    with pytest.raises(FileWriteError, match=message):
        write_text(root, relative, "pwned")
    with pytest.raises(FileWriteError, match=message):
        check_writable(root, relative, overwrite=True)
    assert (outside / "secret.txt").read_text() == "secret" and _listing(outside) == before


def test_a_failed_write_keeps_the_old_file(tree):
    root, _ = tree
    before = _listing(root)

    def fail_halfway(file):
        file.write(b"half")
        raise ValueError("writer failed")

    with pytest.raises(ValueError):
        write_file(root, "reports/plain.md", fail_halfway)
    assert (root / "reports" / "plain.md").read_text() == "old" and _listing(root) == before


def test_existing_file_needs_overwrite_and_directories_are_made_on_request(tree):
    root, _ = tree
    with pytest.raises(FileWriteError, match="already exists; choose another file or pass --force"):
        write_text(root, "reports/plain.md", "new", overwrite=False)
    with pytest.raises(FileWriteError, match="already exists"):
        check_writable(root, "reports/plain.md", overwrite=False)
    with pytest.raises(FileWriteError, match="No such file or directory"):
        write_text(root, "new/deeper/file.txt", "x")
    write_text(root, "new/deeper/file.txt", "x", make_dirs=True)
    assert (root / "new" / "deeper" / "file.txt").read_text() == "x"
    with pytest.raises(FileWriteError, match="is a directory"):
        write_text(root, "new", "x")


def test_reads_only_files_inside_the_directory(tree):
    root, _ = tree
    assert read_text(root, "reports/plain.md") == "old"
    for relative, message in (("reports/linked.md", "is a symbolic link; refusing to read"),
                              ("elsewhere/secret.txt", "elsewhere is a symbolic link"),
                              ("reports/absent.md", "No such file")):
        with pytest.raises(FileReadError, match=message):
            read_text(root, relative)


def test_npz_keeps_arrays_whatever_their_names(tree):
    import numpy as np

    root, _ = tree
    arrays = {"file": np.arange(3), "allow_pickle": np.ones((2, 2), np.float32), "y": np.array(np.nan)}
    write_npz(root, "out.npz", arrays)
    with np.load(root / "out.npz", allow_pickle=False) as saved:
        assert sorted(saved.files) == sorted(arrays)
        for name, array in arrays.items():
            np.testing.assert_array_equal(saved[name], array)
            assert saved[name].dtype == array.dtype
