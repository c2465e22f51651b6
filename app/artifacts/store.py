"""Where artifact files live: one interface, two backends.

- LocalStore: a directory (settings.artifacts_dir), the embedded default. An artifact's URI is
  `file:///abs/dir/<job_id>/<attempt>/<format>`; the worker publishes it with one rename.
- S3Store: an S3-compatible bucket (HIGGS_ARTIFACTS_URL=s3://bucket/prefix, optional
  HIGGS_S3_ENDPOINT_URL for non-AWS stores, credentials the standard AWS way). An artifact's
  URI is `s3://bucket/prefix/<job_id>/<attempt>/<format>`; each file is one object (multipart
  above settings.s3_part_size_mb) carrying its sha256 as object metadata.

Publication is atomic in both: files are written under a key no artifact row names yet, and
become visible only through the rows app.jobs.state.succeed() writes in one transaction. The
worker removes an attempt's objects (and aborts its open multipart uploads) when the attempt is
not recorded as succeeded, and an earlier attempt's leftovers when a new attempt starts.

The API reads through the same interface: ranged streams, existence checks, presigned URLs.
An unreachable or misconfigured store raises StoreUnavailableError (HTTP 503, job error code
storage_unavailable).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from app.errors import AppError, NotFoundError, ServiceUnavailableError

if TYPE_CHECKING:
    from app.settings import Settings

log = logging.getLogger(__name__)

CHUNK = 256 * 1024
STORAGE_UNAVAILABLE = "storage_unavailable"
# S3's smallest part (except the last one) is 5 MiB.
MIN_PART_BYTES = 5 * 2**20


class StoreUnavailableError(ServiceUnavailableError):
    """The artifact store cannot be reached or refuses us (credentials, bucket): a server
    problem (503 + Retry-After), retried once the store is back."""

    code, title = STORAGE_UNAVAILABLE, "Artifact store unavailable"


class StoreObjectMissingError(AppError):
    """A listed file is gone from the store (a broken store, not a client mistake)."""

    status, code, title = 500, "artifact_file_missing", "Artifact file missing from the store"


class ObjectOutsideError(NotFoundError):
    """A local file that resolves outside its artifact (a symlink swapped in): never served."""

    code = "artifact_not_found"


class StoreConfigError(ValueError):
    """HIGGS_ARTIFACTS_URL cannot name a store."""


@dataclass(frozen=True)
class UploadFile:
    path: str  # relative POSIX path inside the artifact
    local: Path
    sha256: str


class ArtifactStore(ABC):
    """One artifact store; URIs name artifact roots (a 'directory' per job attempt and format)."""

    scheme: str
    # A folder on this machine's disk (LocalStore): the worker moves a finished output into
    # place with one rename (its report.json with it) and prunes earlier attempts' folders
    # itself, where a remote store gets the files uploaded.
    on_disk: bool = False

    @abstractmethod
    def describe(self) -> str:
        """The store for logs (no credentials)."""

    @abstractmethod
    def check(self) -> None:
        """Raise StoreUnavailableError when the store cannot be used now."""

    @abstractmethod
    def attempt_uri(self, job_id: str, attempt_name: str) -> str:
        """The root URI of one job attempt (formats are folders below it)."""

    # ---- reading (API)

    @abstractmethod
    def stat(self, root_uri: str, path: str) -> int:
        """Size of a file in bytes; StoreObjectMissingError when it is not there."""

    @abstractmethod
    def open_range(self, root_uri: str, path: str, start: int, end: int) -> Iterator[bytes]:
        """Bytes [start, end) of a file in chunks. The file is opened before this returns (a
        missing file or unreachable store raises here, not while streaming)."""

    def presigned_url(self, root_uri: str, path: str, expires_s: int) -> str | None:
        """A URL that serves the file without the API, or None when the store has none."""
        return None

    # ---- writing (worker)

    @abstractmethod
    def upload(
        self, root_uri: str, files: Sequence[UploadFile], should_stop: Callable[[], bool]
    ) -> bool:
        """Copy files under root_uri. False (and nothing left behind) when should_stop() said
        so between files."""

    @abstractmethod
    def put(
        self, root_uri: str, files: Sequence[UploadFile], should_stop: Callable[[], bool]
    ) -> bool:
        """Write files under root_uri beside what is there (the parts of one artifact written
        by many workers), replacing a file of the same path. A stop between files (False) or
        an error removes nothing else: the files written so far stay, a multipart upload under
        way is aborted. The local files are consumed: LocalStore renames them into place (one
        filesystem, no copy)."""

    @abstractmethod
    def abort_uploads(self, root_uri: str) -> None:
        """Abort every multipart upload still open under root_uri (objects stay)."""

    @abstractmethod
    def delete_tree(self, root_uri: str) -> None:
        """Remove everything under root_uri (and abort open multipart uploads there)."""

    @abstractmethod
    def clear_job(self, job_id: str, keep: str | None) -> None:
        """Remove every attempt of the job except the one under `keep`."""

    def prepare_job(self, job_id: str) -> None:
        """Before an attempt's work: StoreUnavailableError when the store cannot be used now;
        what earlier attempts of the job left (objects, open multipart uploads) goes, since
        none of it is published."""
        self.check()
        self.clear_job(job_id, keep=None)


def join_uri(root_uri: str, path: str) -> str:
    return root_uri.rstrip("/") + "/" + path


# ---------------------------------------------------------------- local directory


def file_uri(path: Path) -> str:
    return Path(path).resolve().as_uri()


def uri_path(uri: str) -> Path:
    """The directory a file:// URI names."""
    u = urlparse(uri)
    if u.scheme != "file":
        raise StoreConfigError(f"{uri!r} is not a file:// URI")
    return Path(unquote(u.path))


class LocalStore(ArtifactStore):
    scheme = "file"
    on_disk = True

    def __init__(self, root: Path) -> None:
        self.root = root

    def describe(self) -> str:
        return f"directory {self.root}"

    def check(self) -> None:
        if not self.root.is_dir():
            raise StoreUnavailableError(f"the artifacts folder {self.root.name!r} does not exist")

    def attempt_uri(self, job_id: str, attempt_name: str) -> str:
        return file_uri(self.root / job_id / attempt_name)

    def _file(self, root_uri: str, path: str) -> Path:
        root = uri_path(root_uri).resolve()
        full = (root / path).resolve()
        if not full.is_relative_to(root):
            raise ObjectOutsideError(f"file {path!r} is outside the artifact")
        if not full.is_file():
            raise StoreObjectMissingError(f"file {path!r} is missing from the store")
        return full

    def stat(self, root_uri: str, path: str) -> int:
        return self._file(root_uri, path).stat().st_size

    def local_file(self, root_uri: str, path: str) -> Path:
        """The file on this machine's disk (served with async file reads)."""
        return self._file(root_uri, path)

    def open_range(self, root_uri: str, path: str, start: int, end: int) -> Iterator[bytes]:
        f = self._file(root_uri, path).open("rb")

        def chunks() -> Iterator[bytes]:
            with f:
                f.seek(start)
                remaining = end - start
                while remaining > 0:
                    chunk = f.read(min(CHUNK, remaining))
                    if not chunk:
                        raise OSError(f"{path} is shorter than its recorded size")
                    remaining -= len(chunk)
                    yield chunk

        return chunks()

    def upload(
        self, root_uri: str, files: Sequence[UploadFile], should_stop: Callable[[], bool]
    ) -> bool:
        root = uri_path(root_uri)
        for f in files:
            if should_stop():
                self.delete_tree(root_uri)
                return False
            dest = root / f.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f.local, dest)
        return True

    def put(
        self, root_uri: str, files: Sequence[UploadFile], should_stop: Callable[[], bool]
    ) -> bool:
        root = uri_path(root_uri)
        for f in files:
            if should_stop():
                return False
            dest = root / f.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(f.local, dest)
            except OSError:  # another filesystem: a copy under a temporary name, then a rename
                tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
                try:
                    shutil.copyfile(f.local, tmp)
                    os.replace(tmp, dest)
                finally:
                    tmp.unlink(missing_ok=True)
        return True

    def abort_uploads(self, root_uri: str) -> None:
        return None

    def delete_tree(self, root_uri: str) -> None:
        shutil.rmtree(uri_path(root_uri), ignore_errors=True)

    def clear_job(self, job_id: str, keep: str | None) -> None:
        job_dir = self.root / job_id
        if not job_dir.is_dir():
            return
        kept = uri_path(keep).resolve() if keep else None
        for p in job_dir.iterdir():
            if kept is None or not (p.resolve() == kept or p.resolve() in kept.parents):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        if kept is None:
            with contextlib.suppress(OSError):
                job_dir.rmdir()

    def prepare_job(self, job_id: str) -> None:
        """Nothing: an attempt makes its folders as it writes them, and earlier attempts'
        folders go once one is recorded as succeeded."""
        return None


# ---------------------------------------------------------------- S3-compatible


def parse_s3_url(url: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at the ends) of s3://bucket[/prefix]."""
    u = urlparse(url)
    if u.scheme != "s3" or not u.netloc:
        raise StoreConfigError(
            f"artifacts URL {url!r} must be s3://bucket[/prefix] (or unset for the local folder)"
        )
    return u.netloc, u.path.strip("/")


class S3Store(ArtifactStore):
    scheme = "s3"

    def __init__(
        self,
        bucket: str,
        prefix: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        part_size: int = 64 * 2**20,
        timeout_s: float = 20.0,
        client: Any = None,
    ) -> None:
        self.bucket, self.prefix = bucket, prefix
        self.endpoint_url = endpoint_url
        self.part_size = max(MIN_PART_BYTES, part_size)
        if client is None:
            import boto3
            from botocore.config import Config

            client = boto3.session.Session().client(
                "s3",
                endpoint_url=endpoint_url,
                region_name=region,
                config=Config(
                    signature_version="s3v4",
                    s3={"addressing_style": "path" if endpoint_url else "auto"},
                    connect_timeout=timeout_s,
                    read_timeout=timeout_s,
                    retries={"max_attempts": 2, "mode": "standard"},
                ),
            )
        self.client = client

    def describe(self) -> str:
        where = f" at {self.endpoint_url}" if self.endpoint_url else ""
        return f"s3://{self.bucket}/{self.prefix}{where}"

    # ---- keys

    def _key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p.strip("/"))

    def attempt_uri(self, job_id: str, attempt_name: str) -> str:
        return f"s3://{self.bucket}/{self._key(job_id, attempt_name)}"

    def _split(self, root_uri: str) -> tuple[str, str]:
        u = urlparse(root_uri)
        if u.scheme != "s3" or not u.netloc:
            raise StoreConfigError(f"{root_uri!r} is not an s3:// URI")
        return u.netloc, u.path.strip("/")

    def _object(self, root_uri: str, path: str) -> tuple[str, str]:
        bucket, key = self._split(root_uri)
        return bucket, f"{key}/{path}" if key else path

    # ---- errors

    def _unavailable(self, exc: BaseException, what: str) -> StoreUnavailableError:
        log.warning(
            "artifact store %s: %s failed: %s: %s", self.describe(), what, type(exc).__name__, exc
        )
        return StoreUnavailableError(
            f"the artifact store cannot be used ({what}: {type(exc).__name__})"
        )

    @contextlib.contextmanager
    def _calls(
        self, what: str, missing: str | None = None, bucket: str | None = None
    ) -> Iterator[None]:
        """Store errors as StoreUnavailableError; with `missing` (a file path), a missing key as
        StoreObjectMissingError. A HEAD answer has no body, so a bare 404 may also mean a
        missing bucket: with `bucket`, the bucket is checked before a 404 counts as a missing
        file."""
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if missing is not None and code in ("NoSuchKey", "404", "NotFound"):
                if code != "NoSuchKey" and bucket is not None:
                    with self._calls("bucket check"):
                        self.client.head_bucket(Bucket=bucket)
                raise StoreObjectMissingError(f"file {missing!r} is missing from the store") from e
            raise self._unavailable(e, f"{what} ({code})") from e
        except BotoCoreError as e:
            raise self._unavailable(e, what) from e
        except S3UploadFailedError as e:
            # upload_file wraps the ClientError of a refused part or PUT (bucket gone, key
            # without write access, a store error) in its own type.
            raise self._unavailable(e, what) from e

    # ---- reading

    def check(self) -> None:
        with self._calls("bucket check"):
            self.client.head_bucket(Bucket=self.bucket)

    def stat(self, root_uri: str, path: str) -> int:
        bucket, key = self._object(root_uri, path)
        with self._calls("stat", missing=path, bucket=bucket):
            head = self.client.head_object(Bucket=bucket, Key=key)
        return int(head["ContentLength"])

    def open_range(self, root_uri: str, path: str, start: int, end: int) -> Iterator[bytes]:
        bucket, key = self._object(root_uri, path)
        if end <= start:
            return iter(())
        with self._calls("download", missing=path):
            obj = self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
        body = obj["Body"]

        def chunks() -> Iterator[bytes]:
            try:
                remaining = end - start
                with self._calls("download"):
                    for chunk in body.iter_chunks(CHUNK):
                        remaining -= len(chunk)
                        yield chunk
                if remaining != 0:
                    raise OSError(
                        f"{path}: the store sent {end - start - remaining} of {end - start} bytes"
                    )
            finally:
                body.close()

        return chunks()

    def presigned_url(self, root_uri: str, path: str, expires_s: int) -> str | None:
        bucket, key = self._object(root_uri, path)
        with self._calls("presign"):
            url: str = self.client.generate_presigned_url(
                "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=expires_s
            )
        return url

    # ---- writing

    def _upload_file(self, bucket: str, key: str, f: UploadFile, cfg: Any) -> None:
        """One file (multipart above the part size) with its sha256 in the object's metadata."""
        with self._calls("upload"):
            self.client.upload_file(
                str(f.local), bucket, key, ExtraArgs={"Metadata": {"sha256": f.sha256}}, Config=cfg
            )

    def _transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self.part_size,
            multipart_chunksize=self.part_size,
            max_concurrency=4,
        )

    def upload(
        self, root_uri: str, files: Sequence[UploadFile], should_stop: Callable[[], bool]
    ) -> bool:
        cfg = self._transfer_config()
        try:
            for f in files:
                if should_stop():
                    self.delete_tree(root_uri)
                    return False
                self._upload_file(*self._object(root_uri, f.path), f, cfg)
        except BaseException:
            with contextlib.suppress(Exception):
                self.delete_tree(root_uri)
            raise
        return True

    def put(
        self, root_uri: str, files: Sequence[UploadFile], should_stop: Callable[[], bool]
    ) -> bool:
        cfg = self._transfer_config()
        for f in files:
            if should_stop():
                return False
            bucket, key = self._object(root_uri, f.path)
            try:
                self._upload_file(bucket, key, f, cfg)
            except BaseException:
                with contextlib.suppress(Exception):
                    self._abort_uploads(bucket, key, exact=True)
                raise
        return True

    def abort_uploads(self, root_uri: str) -> None:
        bucket, key = self._split(root_uri)
        with self._calls("abort uploads"):
            self._abort_uploads(bucket, key + "/")

    def _abort_uploads(
        self, bucket: str, prefix: str, keep: str | None = None, exact: bool = False
    ) -> None:
        """Abort the multipart uploads open under `prefix` (exact: of the key `prefix` only),
        except those under `keep`."""
        uploads = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=bucket, Prefix=prefix
        )
        for page in uploads:
            for up in page.get("Uploads", []):
                if exact and up["Key"] != prefix:
                    continue
                if keep and (up["Key"] == keep or up["Key"].startswith(keep + "/")):
                    continue
                with contextlib.suppress(Exception):  # finished meanwhile
                    self.client.abort_multipart_upload(
                        Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"]
                    )

    def _delete_prefix(self, bucket: str, prefix: str, keep: str | None = None) -> None:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        batch: list[dict[str, str]] = []
        for page in pages:
            for obj in page.get("Contents", []):
                if keep and (obj["Key"] == keep or obj["Key"].startswith(keep + "/")):
                    continue
                batch.append({"Key": obj["Key"]})
                if len(batch) == 1000:
                    self.client.delete_objects(Bucket=bucket, Delete={"Objects": batch})
                    batch = []
        if batch:
            self.client.delete_objects(Bucket=bucket, Delete={"Objects": batch})
        self._abort_uploads(bucket, prefix, keep)

    def delete_tree(self, root_uri: str) -> None:
        bucket, key = self._split(root_uri)
        with self._calls("delete"):
            self._delete_prefix(bucket, key + "/")

    def clear_job(self, job_id: str, keep: str | None) -> None:
        kept = self._split(keep)[1] if keep else None
        with self._calls("cleanup"):
            self._delete_prefix(self.bucket, self._key(job_id) + "/", keep=kept)


# ---------------------------------------------------------------- from the settings


_lock = threading.Lock()


@lru_cache(maxsize=8)
def _s3(
    url: str, endpoint: str | None, region: str | None, part_size: int, timeout_s: float, pid: int
) -> S3Store:
    """One client per process (`pid` in the key: a forked pool process makes its own, never
    sharing the parent's connections)."""
    bucket, prefix = parse_s3_url(url)
    return S3Store(
        bucket,
        prefix,
        endpoint_url=endpoint,
        region=region,
        part_size=part_size,
        timeout_s=timeout_s,
    )


def store_from_settings(settings: Settings) -> ArtifactStore:
    """The store new artifacts go to (HIGGS_ARTIFACTS_URL; unset: the local artifacts folder)."""
    url = settings.artifacts_url
    if not url:
        return LocalStore(settings.artifacts_path)
    with _lock:  # boto3 client creation is not thread-safe
        return _s3(
            url,
            settings.s3_endpoint_url,
            settings.s3_region,
            settings.s3_part_size_mb * 2**20,
            settings.s3_timeout_s,
            os.getpid(),
        )


def store_for_uri(settings: Settings, uri: str) -> ArtifactStore:
    """The store that holds an artifact row's URI: file:// rows are read from this machine's
    disk whatever the configured store (artifacts published before a move to S3 keep working)."""
    scheme = urlparse(uri).scheme
    if scheme == "file":
        return LocalStore(settings.artifacts_path)
    if scheme == "s3":
        configured = store_from_settings(settings)
        if isinstance(configured, S3Store):
            return configured
        raise StoreUnavailableError(
            "an artifact is in an S3 store but this server has no HIGGS_ARTIFACTS_URL=s3://..."
        )
    raise StoreConfigError(f"artifact URI {uri!r} has an unknown scheme")
