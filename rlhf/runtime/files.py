"""Writing files and directories so that a crash never leaves a half-written one in place, and
saying so plainly when the disk is full."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

# torch.save reports a short write as a RuntimeError from its zip writer ("unexpected pos ...",
# "file write failed"); with this little space left, that is a full disk
LOW_SPACE = 64 * 2**20
# the OS's words for ENOSPC / EDQUOT, as native code (Rust, C++) passes them on
NO_SPACE_TEXTS = ("No space left on device", "os error 28", "Disk quota exceeded")


def publish_dir(tmp: Path, out: Path) -> None:
    """Rename a finished directory into place (atomic: a crash never leaves a half-built one).
    If a concurrent job (a parallel sweep sharing the cache) got there first, keep theirs: the
    content is a pure function of the name."""
    try:
        os.replace(tmp, out)
    except OSError:
        if not out.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(tmp: Path, out: Path) -> None:
    """Put the finished directory ``tmp`` at ``out``, replacing what is there only once ``tmp``
    is complete."""
    if out.exists():
        old = out.with_name(out.name + f".old{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)


def dir_size(path: Path | None) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    if path is None or not Path(path).exists():
        return 0
    total = 0
    for file in Path(path).rglob("*"):
        try:
            total += file.stat().st_size if file.is_file() else 0
        except FileNotFoundError:  # removed meanwhile (another rank cleaning up)
            continue
    return total


def free_space(path: Path) -> int:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def out_of_space(err: BaseException, where: Path) -> bool:
    """Whether a failed write failed because the filesystem of ``where`` is full."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # libraries that write in native code report the OS error in their own exception types:
    # safetensors' SafetensorError "... No space left on device (os error 28)"
    if any(text in str(err) for text in NO_SPACE_TEXTS):
        return True
    return isinstance(err, RuntimeError) and free_space(where) < LOW_SPACE


def no_space_message(where: Path, needed: int, at_least: bool = False) -> str:
    """'no space left on device at DIR (12.0 MB free; about 1.3 GB needed)'."""
    about = "at least" if at_least else "about"
    return (
        f"no space left on device at {where} ({human_size(free_space(where))} free; {about} "
        f"{human_size(needed)} needed)"
    )


def human_size(num_bytes: float) -> str:
    """'512 B', '12.3 MB', '1.3 GB' (powers of 1000)."""
    units = ("B", "KB", "MB", "GB")
    power = 0
    while num_bytes >= 1000 and power < len(units) - 1:
        num_bytes, power = num_bytes / 1000, power + 1
    return f"{num_bytes:.0f} B" if power == 0 else f"{num_bytes:.1f} {units[power]}"
