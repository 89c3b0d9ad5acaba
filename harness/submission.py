"""The participant's files, copied into a folder the harness owns before anything runs: train.py,
inference.py, the kernels/ folder beside train.py, and the checkpoint. Each is hashed while it is
copied, so the printed SHA-256 is of the bytes the worker loads; the worker reads the copies and
cannot change them (its sandbox gives it read access only), so swapping a file on disk after the
evaluation started changes nothing.

Only regular files are copied: a symbolic link, a FIFO or a device anywhere in what is copied is
refused with a message (a link could point the copy at a file the worker must not read; a FIFO
would block the copy). Sizes are capped, each with its own message."""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from harness.common import HarnessError

MAX_SOURCE_BYTES = 16 << 20  # train.py / inference.py
MAX_KERNEL_FILES = 2000  # files under kernels/
MAX_KERNEL_BYTES = 256 << 20  # all of kernels/
MAX_CHECKPOINT_BYTES = 64 << 30  # a Phase 2 model in fp32 is ~2.7 GB
COPY_CHUNK = 8 << 20
SKIPPED_DIRS = {"__pycache__"}


def copy_regular_file(source: Path, dest: Path, max_bytes: int, what: str) -> tuple[str, int]:
    """Copy source to dest (mode 0444), refusing anything but a regular file of at most max_bytes;
    returns (SHA-256 of the bytes copied, size)."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise HarnessError(f"{what} {source}: no such file") from None
    except OSError as e:
        if os.path.islink(source):
            raise HarnessError(f"{what} {source} is a symbolic link; pass the file it points to") from None
        raise HarnessError(f"{what} {source} cannot be read ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise HarnessError(f"{what} {source} is not a regular file (a FIFO, device or folder); pass a file")
        if info.st_size > max_bytes:
            raise HarnessError(f"{what} {source} is {info.st_size / 2**20:.1f} MiB, more than the "
                               f"{max_bytes / 2**20:.0f} MiB the harness copies")
        digest, size = hashlib.sha256(), 0
        with os.fdopen(fd, "rb", closefd=False) as src, open(dest, "xb") as out:
            while chunk := src.read(COPY_CHUNK):
                size += len(chunk)
                if size > max_bytes:
                    raise HarnessError(f"{what} {source} grew past {max_bytes / 2**20:.0f} MiB while it was copied")
                digest.update(chunk)
                out.write(chunk)
    except OSError as e:
        raise HarnessError(f"could not copy {what} {source} to {dest.parent} ({e.strerror}); set TMPDIR to a "
                           "folder with room") from None
    finally:
        os.close(fd)
    os.chmod(dest, 0o444)
    return digest.hexdigest(), size


def copy_kernels(source: Path, dest: Path) -> str:
    """Copy the folder tree (regular files and folders only, __pycache__ skipped); returns one
    SHA-256 over the sorted (relative path, file hash) pairs."""
    entries, files, total = [], 0, 0
    for root, dirs, names in os.walk(source, followlinks=False):
        root_path = Path(root)
        for d in sorted(dirs):
            if os.path.islink(root_path / d):
                raise HarnessError(f"{root_path / d} is a symbolic link; kernels/ may hold only files and folders")
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        (dest / root_path.relative_to(source)).mkdir(parents=True, exist_ok=True)
        for name in sorted(names):
            files += 1
            if files > MAX_KERNEL_FILES:
                raise HarnessError(f"{source} holds more than {MAX_KERNEL_FILES} files; the harness copies at most "
                                   "that many")
            relative = (root_path / name).relative_to(source)
            digest, size = copy_regular_file(root_path / name, dest / relative, MAX_KERNEL_BYTES, "kernel file")
            total += size
            if total > MAX_KERNEL_BYTES:
                raise HarnessError(f"{source} holds more than {MAX_KERNEL_BYTES >> 20} MiB; the harness copies at "
                                   "most that much")
            entries.append(f"{relative.as_posix()}\0{digest}")
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()


@dataclass
class Submission:
    """The harness's private copy: `dir` holds train.py, inference.py (if given), kernels/ and
    checkpoint/<name>; `sha256` maps each to the hash of its copy."""
    dir: Path
    train_py: Path | None
    checkpoint: Path
    inference_py: Path | None = None
    sha256: dict = field(default_factory=dict)

    def close(self) -> None:
        for root, dirs, _ in os.walk(self.dir):
            os.chmod(root, 0o700)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def copy_submission(train_py, checkpoint, inference_py=None) -> Submission:
    """Copy the participant's files into a new folder the harness owns (see the module docstring):
    train.py (None: there is none, e.g. CORE without verification), inference.py if given, the
    kernels/ folder beside train.py (else beside inference.py), and the checkpoint."""
    checkpoint = Path(checkpoint)
    folder = Path(tempfile.mkdtemp(prefix="frontier-submission-"))
    try:
        sub = Submission(folder, None, folder / "checkpoint" / checkpoint.name)
        if train_py is not None:
            sub.train_py = folder / "train.py"
            sub.sha256["train_py"] = copy_regular_file(Path(train_py), sub.train_py, MAX_SOURCE_BYTES, "train.py")[0]
        if inference_py is not None:
            sub.inference_py = folder / "inference.py"
            sub.sha256["inference_py"] = copy_regular_file(Path(inference_py), sub.inference_py, MAX_SOURCE_BYTES,
                                                           "inference.py")[0]
        kernels = Path(train_py if train_py is not None else inference_py).parent / "kernels"
        if kernels.is_dir() and not kernels.is_symlink():
            sub.sha256["kernels"] = copy_kernels(kernels, folder / "kernels")
        elif kernels.is_symlink():
            raise HarnessError(f"{kernels} is a symbolic link; kernels/ must be a folder beside train.py")
        sub.checkpoint.parent.mkdir()
        sub.sha256["checkpoint"] = copy_regular_file(checkpoint, sub.checkpoint, MAX_CHECKPOINT_BYTES,
                                                     "checkpoint")[0]
        for root, dirs, _ in os.walk(folder):
            os.chmod(root, 0o555)
        return sub
    except BaseException:
        Submission(folder, folder, folder).close()
        raise
