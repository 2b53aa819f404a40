"""Checkpoint files: an atomic save, and a load whose failure on a damaged file says so.

``torch.save`` writes in place, so a run killed mid-save leaves a truncated file that the next
``torch.load`` rejects with a zip or unpickling error that does not name the cause.
``save_checkpoint`` writes beside the target and renames (atomic on POSIX and Windows), so the
file at ``path`` is always a whole checkpoint; ``load_checkpoint`` explains a damaged one.
"""
from __future__ import annotations

import os
import pickle
import zipfile

import torch


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be read: truncated, corrupted, or not a torch.save file."""


def save_checkpoint(obj, path) -> None:
    """``torch.save(obj, path)``, atomically: a crash leaves the previous file, never half a new
    one.

    Args:
        obj: what to save (``{"model": ..., "optimizer": ..., "amp": amp.state_dict()}``).
        path: the file to write; a temporary file beside it is renamed onto it.

    Raises:
        OSError: the file cannot be written (the temporary file is removed).
    """
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path, **torch_load_kwargs):
    """``torch.load(path, **torch_load_kwargs)``, with a damaged file named as such.

    Args:
        path: the checkpoint file.
        torch_load_kwargs: passed to ``torch.load`` (``map_location=``, ``weights_only=``).

    Returns:
        What was saved.

    Raises:
        CheckpointError: the file is truncated or corrupted (the message names the file, its
            size, the cause and the fix).
        FileNotFoundError: there is no such file.
    """
    path = os.fspath(path)
    try:
        return torch.load(path, **torch_load_kwargs)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile,
            ValueError, KeyError) as exc:
        if "Unsupported global" in str(exc):
            raise   # a whole file that names a class weights_only refuses: torch explains it
        size = os.path.getsize(path)
        raise CheckpointError(
            f"checkpoint {path!r} ({size} bytes) is truncated or corrupted and cannot be read "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). A run "
            f"killed while saving leaves such a file: resume from an earlier checkpoint, and "
            f"save with amp.save_checkpoint (it writes a temporary file and renames it, so the "
            f"file at the path is always complete). Nothing was loaded.") from exc
