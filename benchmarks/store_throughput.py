#!/usr/bin/env python
"""Artifact store throughput on loopback: the local store (a file copy into the artifacts
folder, which is what publication costs there besides a rename) against the S3 store on a real
SeaweedFS server (`weed mini` from the dev extra), for the same files, in one run.

For each file size: upload (the worker's publication: app.artifacts.store.*.upload with the
multipart part size of the settings) and a whole-file ranged read through the store interface
(what the API streams), in MB/s (10^6 bytes per second), best of --repeats. Everything runs on
this machine: client, server and disk share its CPUs, so the figures are a floor for a store on
its own hosts, not a forecast.

Writes benchmarks/results/store_throughput.json + .md.

Usage: python -m benchmarks.store_throughput [--sizes-mb 8 64 256] [--repeats 3] [--part-mb 16]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from app.artifacts.store import ArtifactStore, LocalStore, S3Store, UploadFile, join_uri
from benchmarks.common import markdown_table, write_results
from devtools.seaweed import running_s3


def make_file(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with path.open("wb") as f:
        left = size
        while left:
            chunk = os.urandom(min(left, 4 << 20))
            f.write(chunk)
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def measure(store: ArtifactStore, src: Path, sha: str, size: int, attempt: str) -> dict[str, float]:
    uri = store.attempt_uri("bench", attempt)
    t0 = time.perf_counter()
    if not store.upload(uri, [UploadFile(f"native/{src.name}", src, sha)], lambda: False):
        raise RuntimeError(f"{store.describe()}: upload stopped")
    up = time.perf_counter() - t0
    root = join_uri(uri, "native")
    h = hashlib.sha256()
    t0 = time.perf_counter()
    n = 0
    for chunk in store.open_range(root, src.name, 0, size):
        h.update(chunk)
        n += len(chunk)
    down = time.perf_counter() - t0
    if n != size or h.hexdigest() != sha:
        raise RuntimeError(f"{store.describe()}: read back {n} bytes, digest mismatch")
    store.delete_tree(uri)
    return {"upload_s": up, "download_s": down}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--part-mb", type=int, default=16)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="store-bench-") as tmp_s:
        tmp = Path(tmp_s)
        with running_s3(tmp / "s3") as server:
            s3 = S3Store(
                server.bucket,
                "bench",
                endpoint_url=server.endpoint,
                part_size=args.part_mb << 20,
                client=server.client(),
            )
            local = LocalStore(tmp / "artifacts")
            (tmp / "artifacts").mkdir()
            for mb in args.sizes_mb:
                size = mb * 2**20
                src = tmp / f"file-{mb}.bin"
                sha = make_file(src, size)
                for name, store in (("local", local), ("s3 (SeaweedFS)", s3)):
                    runs = [
                        measure(store, src, sha, size, f"{mb}.{i}") for i in range(args.repeats)
                    ]
                    up = min(r["upload_s"] for r in runs)
                    down = min(r["download_s"] for r in runs)
                    row = {
                        "store": name,
                        "size_mb": mb,
                        "upload_s": round(up, 4),
                        "download_s": round(down, 4),
                        "upload_mb_s": round(size / up / 1e6, 1),
                        "download_mb_s": round(size / down / 1e6, 1),
                    }
                    rows.append(row)
                    print(row, flush=True)
                src.unlink()
    payload = {
        "benchmark": "store_throughput",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "settings": {"repeats": args.repeats, "part_mb": args.part_mb},
        "rows": rows,
    }
    md = "\n\n".join(
        [
            "# Artifact store throughput on loopback",
            f"Best of {args.repeats}; S3 multipart part size {args.part_mb} MiB; client and "
            f"server on one machine ({os.cpu_count()} CPUs, shared). MB = 10^6 bytes. Upload = "
            "the worker's publication of one file; download = a whole-file read through the "
            "store interface (what the API streams), sha256 checked.",
            markdown_table(
                rows,
                [
                    ("store", "store"),
                    ("size_mb", "file MiB"),
                    ("upload_mb_s", "upload MB/s"),
                    ("download_mb_s", "download MB/s"),
                ],
            ),
        ]
    )
    js, mdp = write_results("store_throughput", payload, md)
    print(f"wrote {js} and {mdp}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
