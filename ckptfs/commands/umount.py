"""``ckptfs umount MOUNTPOINT``: unmount a ckptfs mount, live or stale (``fusermount3 -u``, lazily if busy)."""
from __future__ import annotations


def add_parser(subparsers):
    p = subparsers.add_parser(
        "umount", help="unmount a ckptfs mount (also clears a stale one)",
        description="Unmount MOUNTPOINT with fusermount3 -u; if it is busy, detach it lazily (-u -z) so it "
                    "disappears when the last process leaves it. Also clears a stale mount left by a killed server.")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    return p


def run(args) -> int:
    from ..fuse.mount import unmount

    done = unmount(args.mountpoint)
    print(f"ckptfs: {done} {args.mountpoint}")
    return 0
