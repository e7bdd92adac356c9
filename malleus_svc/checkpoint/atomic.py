"""Durable, all-or-nothing directory publication (files themselves are fsynced by their writers,
runtime/shard_files.py).

A checkpoint is written into a private temporary directory, every file flushed and fsynced, the
directory fsynced, then renamed to its final name and the parent fsynced. rename(2) within one
file system is atomic, so a reader sees either no checkpoint or a complete one, also after a
crash or power loss (the fsyncs order the data before the rename on disk).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync a directory, so the names created/renamed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Atomically give the complete directory `tmp` the name `final` (same parent).

    If `final` already exists (the same step written again, e.g. after resuming from an older
    checkpoint), it is first moved aside and removed afterwards: at no moment does `final` name a
    partial directory.
    """
    fsync_dir(tmp)
    aside = None
    if final.exists():
        aside = final.with_name(f"{final.name}.del-{os.getpid()}")
        remove_tree(aside)
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if aside is not None:
        remove_tree(aside)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def retire(path: Path) -> None:
    """Remove a published directory: first renamed out of the namespace readers look at (atomic),
    so a crash halfway through the deletion never leaves a half-deleted 'checkpoint'."""
    aside = path.with_name(f"{path.name}.del-{os.getpid()}")
    remove_tree(aside)
    os.rename(path, aside)
    fsync_dir(path.parent)
    remove_tree(aside)
