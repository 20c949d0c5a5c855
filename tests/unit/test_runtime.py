"""What the tools find out about mounts without a daemon: paths resolved up
to a mount point."""

import os

from ckptfs.runtime import resolved_to_mount


def test_links_are_followed_up_to_a_mount_point_and_no_further(tmp_path):
    (tmp_path / "real" / "mnt").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "rel").symlink_to("link/mnt")
    (tmp_path / "real" / "mnt" / "inside").symlink_to("/elsewhere")  # under the mount point: the daemon's to follow
    mounts = [str(tmp_path / "real" / "mnt")]
    mp = str(tmp_path / "real" / "mnt")
    assert resolved_to_mount(tmp_path / "link" / "mnt", mounts) == mp
    assert resolved_to_mount(f"{tmp_path}/link/mnt/", mounts) == mp
    assert resolved_to_mount(tmp_path / "rel" / "a" / "b", mounts) == f"{mp}/a/b"
    assert resolved_to_mount(tmp_path / "link" / "mnt" / "inside" / "x", mounts) == f"{mp}/inside/x"
    assert resolved_to_mount(tmp_path / "link" / "none", mounts) == str(tmp_path / "real" / "none")  # not there: as it is
    assert resolved_to_mount(tmp_path / "link" / "mnt", []) == mp  # no mount: every link followed


def test_a_loop_of_links_gives_the_path_as_it_was(tmp_path):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    assert resolved_to_mount(tmp_path / "a" / "x", []) == os.path.join(tmp_path, "a", "x")
