"""Where checkpoints and exports go: a local directory, or an object-store prefix named by a URI
(``s3://bucket/prefix``, ``gs://``, ``abfs://``) that `pyarrow.fs` opens, as Ray Train's storage
does. The rules on the names live here; the I/O is runtime/storage.py's.
"""
from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

# What pyarrow.fs opens as an object store (or HDFS); file:// is a local directory.
OBJECT_SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss", "hdfs")
ACCEPTED = ("a local directory, or a URI of an object store: " + ", ".join(f"{s}://" for s in OBJECT_SCHEMES)
            + " (file:// is a local directory)")


class Uri(str):
    """An object-store location; `name` and `/` as a `Path` has them (a Path would fold the `//`)."""

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]

    def __truediv__(self, child: str) -> "Uri":
        return Uri(f"{self.rstrip('/')}/{child}")


def location(where: str | Path) -> Path | Uri:
    """A local path (also for ``file://``) or a `Uri`; ValueError (with `ACCEPTED`) for any other scheme."""
    if isinstance(where, (Path, Uri)):
        return where
    text = str(where)
    if "://" not in text:
        return Path(text)
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme == "file":
        return Path(unquote(parts.path))
    if scheme not in OBJECT_SCHEMES or not parts.netloc or parts.username or parts.password:
        raise ValueError(f"{text!r} is not {ACCEPTED}; credentials come from the environment, never the URI")
    return Uri(text.rstrip("/"))


def is_remote(where: str | Path) -> bool:
    return isinstance(location(where), Uri)
