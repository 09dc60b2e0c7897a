"""Object-store I/O for the adapter store: retries, whole-object writes, exclusive create.

Choices made here:

* Every call to the filesystem goes through ``StoreIO._call``: transient
  errors (connection resets, timeouts, HTTP 5xx, 429 and S3 throttling codes
  such as ``SlowDown``) are retried with exponential backoff and jitter
  (``RetryPolicy``); permanent ones (403, a missing bucket, a bad request) and
  exhausted retries raise ``StoreError`` naming the operation and the object.
  ``FileNotFoundError`` / ``FileExistsError`` pass through: callers give them a
  meaning (absent object, lost race).
* A whole-object write is atomic for readers: object stores replace objects
  atomically; on a local disk the bytes go to a temp name that is renamed.
* ``create`` writes an object only if it does not exist yet, atomically:
  ``os.link`` of a complete temp file on a local disk, an S3 conditional PUT
  (``If-None-Match: *``, through s3fs ``pipe_file(mode="create")``) on S3, a
  process lock on ``memory://``. Other fsspec backends fall back to their own
  ``mode="create"``, which may check-then-write; the caller reads back what it
  created to catch that case.
* Local stores refuse symbolic links when reading: the store holds plain files.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from lora_rl_core.errors import StoreError

log = logging.getLogger(__name__)
T = TypeVar("T")

TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "TooManyRequests",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "ConditionalRequestConflict",  # S3: another conditional write to the key is in flight
    }
)
_TRANSIENT_CLASS_NAMES = frozenset(
    {
        "HTTPClientError",  # botocore: ReadTimeoutError, ConnectionClosedError, ...
        "ConnectionError",  # botocore's own, e.g. EndpointConnectionError
        "IncompleteReadError",
        "ResponseParserError",
        "ClientPayloadError",  # aiohttp
        "ClientConnectionError",
        "ServerDisconnectedError",
        "IncompleteRead",
    }
)
_TRANSIENT_ERRNOS = frozenset({errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.EREMOTEIO})
_PERMANENT_TYPES = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
_MEMORY_LOCK = threading.Lock()


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for transient store errors.

    Args:
        attempts: tries per operation, the first included (>= 1).
        base_delay_s: delay before the second try, in seconds; doubles each try.
        max_delay_s: cap on one delay, in seconds.
    """

    attempts: int = 5
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed try number ``attempt`` (1-based): half fixed, half random."""
        cap = min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1))
        return cap * (0.5 + 0.5 * random.random())


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes / contexts, outermost first."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < 8:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _http_error(exc: BaseException) -> tuple[str, int | None] | None:
    """(error code, HTTP status) of a botocore ``ClientError``-like exception, else None."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict) or not isinstance(response.get("Error"), dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return str(response["Error"].get("Code", "")), status


def is_precondition_failed(exc: BaseException) -> bool:
    """True if ``exc`` is (or wraps) an HTTP 412 from a conditional write: the object already exists."""
    for e in _chain(exc):
        if isinstance(e, FileExistsError):
            return True
        http = _http_error(e)
        if http is not None:
            return http[0] == "PreconditionFailed" or http[1] == 412
    return False


def is_transient(exc: BaseException) -> bool:
    """True if ``exc`` (or what it wraps) is worth retrying: 5xx, 429, throttling, timeouts, dropped connections."""
    for e in _chain(exc):
        http = _http_error(e)
        if http is not None:
            code, status = http
            return code in TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429))
        if isinstance(e, _PERMANENT_TYPES):
            return False
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if any(cls.__name__ in _TRANSIENT_CLASS_NAMES for cls in type(e).__mro__):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
    return False


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or repr(exc)
    return f"{type(exc).__name__}: {text}"


class StoreIO:
    """Retried, size-limited, symlink-refusing operations on one fsspec filesystem.

    Paths are the filesystem's own (protocol stripped); ``uri(path)`` adds the protocol back for messages.

    Args:
        fs: the fsspec filesystem.
        retry: backoff for transient errors.
    """

    def __init__(self, fs: AbstractFileSystem, retry: RetryPolicy):
        self.fs = fs
        self.retry = retry
        self.local = isinstance(fs, LocalFileSystem)

    def uri(self, path: str) -> str:
        """``path`` as a URI with its protocol, for messages and refs."""
        return self.fs.unstrip_protocol(path)

    def _call(self, what: str, path: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with retries; StoreError on permanent or exhausted errors."""
        for attempt in range(1, self.retry.attempts + 1):
            try:
                return fn()
            except (FileNotFoundError, FileExistsError, StoreError):
                raise
            except Exception as e:
                if is_precondition_failed(e):
                    raise FileExistsError(path) from e
                if not is_transient(e):
                    raise StoreError(f"{what} {self.uri(path)} failed: {_describe(e)}") from e
                if attempt == self.retry.attempts:
                    raise StoreError(
                        f"{what} {self.uri(path)} failed after {attempt} attempts: {_describe(e)}; "
                        "the store may be down or throttling, try again later"
                    ) from e
                delay = self.retry.delay(attempt)
                log.warning(
                    "%s %s: %s (try %d/%d), retrying in %.2fs", what, path, e, attempt, self.retry.attempts, delay
                )
                time.sleep(delay)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------- reads

    def _refuse_symlink(self, path: str) -> None:
        if self.local and (os.path.islink(path) or os.path.islink(os.path.dirname(path))):
            raise StoreError(f"{self.uri(path)} is a symbolic link; the store must hold plain files, refusing it")

    def size(self, path: str) -> int | None:
        """Size of an object in bytes, or None if it does not exist."""
        self._refuse_symlink(path)
        try:
            return int(self._call("stat", path, lambda: self.fs.info(path)["size"]))
        except FileNotFoundError:
            return None

    def get(self, path: str, max_bytes: int) -> bytes | None:
        """The bytes of an object, or None if it does not exist.

        Raises:
            StoreError: the object is a symlink (local stores), larger than ``max_bytes``, or cannot be read.
        """
        size = self.size(path)
        if size is None:
            return None
        if size > max_bytes:
            raise StoreError(
                f"{self.uri(path)} is {size} bytes, over the limit of {max_bytes} bytes; refusing to read it"
            )
        try:
            return self._call("read", path, lambda: self.fs.cat_file(path))
        except FileNotFoundError:
            return None

    def find(self, path: str) -> list[str]:
        """Every file under folder ``path`` (recursive), [] if there is none."""
        try:
            return list(self._call("list", path, lambda: self.fs.find(path)))
        except FileNotFoundError:
            return []

    def ls_dirs(self, path: str) -> list[str]:
        """Names (last segment) of the sub-folders of ``path``, [] if it does not exist."""
        try:
            entries = self._call("list", path, lambda: self.fs.ls(path, detail=True))
        except FileNotFoundError:
            return []
        return [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory"]

    # ------------------------------------------------------------- writes

    def put(self, path: str, data: bytes) -> None:
        """Write a whole object; readers see the old bytes or the new ones, never a part.

        Raises:
            StoreError: the write failed (after retries for transient errors).
        """
        if self.local:
            try:
                self._call("write", path, lambda: self._put_local(path, data))
            except (FileNotFoundError, FileExistsError) as e:
                raise StoreError(f"write {self.uri(path)} failed: {_describe(e)}") from e
            return
        try:
            self._call("write", path, lambda: self.fs.pipe_file(path, data))
        except FileNotFoundError as e:
            raise StoreError(f"write {self.uri(path)} failed: its bucket or folder does not exist ({e})") from e
        except FileExistsError as e:  # a path segment is a file
            raise StoreError(f"write {self.uri(path)} failed: {_describe(e)}") from e

    def _put_local(self, path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def create(self, path: str, data: bytes) -> bool:
        """Write a whole object only if none exists at ``path``.

        Returns:
            True if this call created it, False if an object was already there.

        Raises:
            StoreError: the write failed (after retries for transient errors).
        """
        try:
            if self.local:
                self._call("create", path, lambda: self._create_local(path, data))
            elif isinstance(self.fs, MemoryFileSystem):
                self._call("create", path, lambda: self._create_memory(path, data))
            else:
                self._call("create", path, lambda: self.fs.pipe_file(path, data, mode="create"))
        except FileExistsError:
            return False
        except FileNotFoundError as e:
            raise StoreError(f"create {self.uri(path)} failed: its bucket or folder does not exist ({e})") from e
        return True

    def _create_local(self, path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            try:
                os.link(tmp, path)  # atomic and complete; FileExistsError if path exists
            except FileExistsError:
                raise
            except OSError:  # a filesystem without hard links: exclusive open, one small write
                with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as f:
                    f.write(data)
        finally:
            os.unlink(tmp)

    def _create_memory(self, path: str, data: bytes) -> None:
        with _MEMORY_LOCK:
            if self.fs.exists(path):
                raise FileExistsError(path)
            self.fs.pipe_file(path, data)

    def rm(self, path: str) -> None:
        """Delete one object; a missing object is fine."""
        try:
            self._call("delete", path, lambda: self.fs.rm_file(path))
        except FileNotFoundError:
            pass

    def rm_tree(self, path: str) -> None:
        """Delete a folder and everything under it; a missing folder is fine."""
        for file in self.find(path):
            self.rm(file)
        if self.local or isinstance(self.fs, MemoryFileSystem):  # folders are real here, not key prefixes
            try:
                self._call("delete", path, lambda: self.fs.rm(path, recursive=True))
            except FileNotFoundError:
                pass
