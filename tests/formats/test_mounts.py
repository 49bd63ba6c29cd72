"""Which file system holds a path (formats/mounts.py)."""

from ckptstore.formats.mounts import file_system, keeps_inodes, keeps_modes


def test_the_file_system_of_a_path_is_read_from_the_mount_table():
    """The mount nearest above a path decides, its point unescaped (a space is written \\040), the later of two."""
    table = ("1 0 8:1 / / rw - ext4 /dev/sda rw\n"
             "2 1 8:2 / /media/my\\040usb rw shared:1 - exfat /dev/sdb rw\n"
             "3 1 0:50 / /home/u/remote rw - fuse.sshfs u@h: rw\n"
             "4 1 0:51 / /home/u/remote rw - ext4 /dev/sdc rw\n")
    assert file_system("/media/my usb/run", table) == "exfat"
    assert file_system("/media/my usbx", table) == "ext4"
    assert file_system("/home/u/remote/a", table) == "ext4"
    assert file_system("/home/u/remote/a", table.rsplit("4 1", 1)[0]) == "fuse.sshfs"


def test_this_machines_own_disk_keeps_modes_and_inodes(tmp_path):
    assert keeps_modes(tmp_path) and keeps_inodes(tmp_path)
