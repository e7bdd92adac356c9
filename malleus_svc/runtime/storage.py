"""Objects under an object-store prefix (`pyarrow.fs`: S3 and S3-compatible servers, GCS, Azure,
HDFS), for the checkpoint's writers and readers.

An object store has no rename and no directory to fsync: a checkpoint's files are uploaded into
its final prefix and its manifest last, the commit record (checkpoint/store.py). Objects are
streamed up from a local file and down into one, hashed on the way, so the safetensors readers and
writers only ever see local files and memory stays bounded.

Endpoints and credentials come from the environment, as every S3 tool reads them
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_DEFAULT_REGION,
GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_ACCOUNT_KEY, ...); `storage_env` gives the ones set
in the driver, for the actors it starts.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from malleus_svc.config.locations import Uri

_CHUNK = 8 << 20
_ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_")


def storage_env() -> dict[str, str]:
    """The object stores' settings in this process's environment (to hand to the actors it starts)."""
    return {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}


class Bucket:
    """The objects under one prefix; names are relative to it. Errors are OSError (pyarrow's)."""

    def __init__(self, uri: str):
        from pyarrow import fs

        self.uri = Uri(str(uri).rstrip("/"))
        try:
            self._fs, self._base = fs.FileSystem.from_uri(self.uri)
        except Exception as e:  # noqa: BLE001 - pyarrow's ArrowInvalid for a malformed URI
            raise OSError(f"{self.uri} cannot be opened: {e}") from None
        self._base = self._base.rstrip("/")

    def child(self, name: str) -> "Bucket":
        return Bucket(self.uri / name)

    def _key(self, name: str) -> str:
        return f"{self._base}/{name}"

    def size(self, name: str) -> int | None:
        """The object's size in bytes; None if there is no such object."""
        from pyarrow import fs

        info = self._fs.get_file_info(self._key(name))
        return info.size if info.type == fs.FileType.File else None

    def listing(self) -> tuple[list[str], list[str]]:
        """(prefixes, objects) right under this prefix, by name."""
        from pyarrow import fs

        infos = self._fs.get_file_info(fs.FileSelector(self._base, allow_not_found=True))
        dirs = [i.base_name for i in infos if i.type == fs.FileType.Directory]
        return dirs, [i.base_name for i in infos if i.type == fs.FileType.File]

    def read(self, name: str, most: int) -> bytes:
        """At most `most` + 1 bytes of the object (so a caller can tell it is larger)."""
        with self._fs.open_input_stream(self._key(name)) as f:
            return f.read(most + 1)

    def write(self, name: str, data: bytes) -> None:
        with self._fs.open_output_stream(self._key(name)) as f:
            f.write(data)

    def upload(self, local: Path, name: str) -> None:
        """The local file as the object `name` (whole or not at all: an upload that fails is aborted)."""
        with open(local, "rb") as src, self._fs.open_output_stream(self._key(name)) as dst:
            while chunk := src.read(_CHUNK):
                dst.write(chunk)

    def download(self, name: str, dest: Path, most: int) -> tuple[str, int]:
        """At most `most` + 1 bytes of the object into the new local file `dest`; (sha256, bytes)."""
        h, n = hashlib.sha256(), 0
        with self._fs.open_input_stream(self._key(name)) as src, open(dest, "xb") as out:
            while n <= most and (chunk := src.read(min(_CHUNK, most + 1 - n))):
                h.update(chunk)
                out.write(chunk)
                n += len(chunk)
        return h.hexdigest(), n

    def delete(self, name: str) -> None:
        if self.size(name) is not None:
            self._fs.delete_file(self._key(name))

    def delete_all(self) -> None:
        """Every object under this prefix."""
        dirs, files = self.listing()
        if dirs or files:
            self._fs.delete_dir(self._base)
