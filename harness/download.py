"""Robust downloads: retries with exponential backoff, the body in a private temp folder, checked
against Content-Length and a validator, and only then renamed to its final name."""
from __future__ import annotations

import http.client
import os
import random
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

from harness.common import DownloadError, HarnessError, tmp_name

DOWNLOAD_WORKERS = 8
DOWNLOAD_ATTEMPTS = 5
DOWNLOAD_BACKOFF_SECONDS = 2.0  # wait before retry k is this * 2**(k-1), plus jitter
DOWNLOAD_TIMEOUT_SECONDS = 60.0  # per socket operation, not per file

_RETRYABLE_HTTP = {408, 425, 429, 500, 502, 503, 504}


def download_file(url: str, dest: Path, validate=None, attempts: int | None = None, backoff: float | None = None,
                  timeout: float | None = None) -> int:
    """Fetch url to dest. The body goes to a .tmp folder, must match Content-Length and pass
    validate(path), and only then is renamed to dest. Returns the byte count; DownloadError after
    the last attempt, naming the file and every failure. Unset limits take the DOWNLOAD_* constants."""
    attempts = DOWNLOAD_ATTEMPTS if attempts is None else attempts
    backoff = DOWNLOAD_BACKOFF_SECONDS if backoff is None else backoff
    timeout = DOWNLOAD_TIMEOUT_SECONDS if timeout is None else timeout
    dest.parent.mkdir(parents=True, exist_ok=True)
    failures = []
    for attempt in range(1, attempts + 1):
        staging = tmp_name(dest)  # a private folder, so the file keeps its own name while it is checked
        staging.mkdir(parents=True, exist_ok=True)
        tmp = staging / dest.name
        try:
            request = urllib.request.Request(url, headers={"User-Agent": "trainium-frontier-kit"})
            with urllib.request.urlopen(request, timeout=timeout) as response:
                expected = response.headers.get("Content-Length")
                received = 0
                with open(tmp, "wb") as f:
                    while chunk := response.read(1 << 20):
                        f.write(chunk)
                        received += len(chunk)
            if expected is not None and received != int(expected):
                raise DownloadError(f"truncated body: {received} of {expected} bytes")
            if validate is not None:
                validate(tmp)
            os.replace(tmp, dest)
            return received
        except urllib.error.HTTPError as e:
            failures.append(f"attempt {attempt}: HTTP {e.code} {e.reason}")
            if e.code not in _RETRYABLE_HTTP:
                break
        except (urllib.error.URLError, http.client.HTTPException, OSError, HarnessError) as e:
            failures.append(f"attempt {attempt}: {type(e).__name__}: {e}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if attempt < attempts:
            time.sleep(backoff * 2 ** (attempt - 1) * (1 + 0.25 * random.random()))
    raise DownloadError(f"{dest.name}: download failed from {url}\n    " + "\n    ".join(failures))

