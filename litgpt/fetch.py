"""Files fetched over the network: any URL into a file, resumed after a dropped connection and tried again after a
transient failure (`url_download`), and the retry with backoff that `litgpt download` uses for the hub too."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional, TypeVar

from litgpt.errors import UserError

# Tries of a download that fails transiently (dropped connection, timeout, 5xx, 429), and the waits between them:
# BACKOFF_SECONDS, doubled after each failure, at most BACKOFF_CAP_SECONDS (also caps a server's Retry-After).
DOWNLOAD_ATTEMPTS = 5
BACKOFF_SECONDS = 1.0
BACKOFF_CAP_SECONDS = 30.0
# Bytes read from the connection at a time.
READ_BYTES = 1 << 20

T = TypeVar("T")


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


RETRIED_STATUSES = {408, 429, 500, 502, 503, 504}


class _Transient(Exception):
    """A failure worth another try: the connection broke, timed out, or the server asked to come back later."""

    def __init__(self, why: str, retry_after: Optional[float] = None) -> None:
        super().__init__(why)
        self.retry_after = retry_after


def http_status(error: BaseException) -> Optional[int]:
    return getattr(getattr(error, "response", None), "status_code", None)


def with_retries(action: Callable[[], T], is_transient: Callable[[BaseException], bool], what: str,
                 attempts: Optional[int] = None) -> T:
    """`action()`, tried again after a transient failure (up to `attempts`, default DOWNLOAD_ATTEMPTS) with
    exponential backoff; the last failure, and any other, is raised as it is."""
    attempts = attempts or DOWNLOAD_ATTEMPTS
    for attempt in range(1, attempts + 1):
        try:
            return action()
        except Exception as error:  # `is_transient` sorts them: the others are raised as they are
            if attempt == attempts or not is_transient(error):
                raise
            delay = min(BACKOFF_CAP_SECONDS, BACKOFF_SECONDS * 2 ** (attempt - 1))
            if getattr(error, "retry_after", None) is not None:  # the server said when
                delay = min(BACKOFF_CAP_SECONDS, error.retry_after)
            print(f"{what}: {first_line(error)}; trying again in {delay:.0f} s ({attempt + 1}/{attempts})",
                  file=sys.stderr, flush=True)
            time.sleep(delay)
    raise AssertionError("unreachable")


def url_download(url: str, path: Path, size: Optional[int] = None, sha256: Optional[str] = None) -> None:
    """Fetch `url` into `path` unless the file is there.

    The bytes go to `path` + ".part" and it is renamed when complete and checked: its size (the server's, and `size`
    when given) and its SHA-256 when `sha256` is given. A partial file left by an earlier try is resumed with an HTTP
    Range request. Dropped connections, timeouts, 5xx and 429 answers are tried again with backoff; anything else
    (404, 403, no network) is a UserError saying where to put the file by hand.
    """
    path = Path(path)
    if path.is_file():
        return
    partial = path.with_name(path.name + ".part")
    by_hand = f"Download it yourself and put it at {str(path)!r}."
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        total = with_retries(lambda: _fetch_into(url, partial), lambda e: isinstance(e, _Transient),
                             f"Downloading {url}")
    except _Transient as error:
        raise UserError(
            f"Could not download {url} ({error}; gave up after {DOWNLOAD_ATTEMPTS} tries). {by_hand}"
        ) from None
    except OSError as error:  # HTTPError and URLError are OSErrors: 404, 403, no network, disk full
        raise UserError(f"Could not download {url} ({_download_error(error)}). {by_hand}") from None
    _verify_download(url, partial, total if size is None else size, sha256, by_hand)
    os.replace(partial, path)


def _download_error(error: OSError) -> str:
    import urllib.error

    if isinstance(error, urllib.error.HTTPError):
        return f"HTTP {error.code} {error.reason}"
    if isinstance(error, urllib.error.URLError):
        return first_line(error.reason) if isinstance(error.reason, BaseException) else str(error.reason)
    return first_line(error)


def _fetch_into(url: str, partial: Path) -> Optional[int]:
    """Append the rest of `url` to `partial` (all of it when there is none, or when the server ignores the Range);
    returns the full size when the server said it. Transient failures are raised as `_Transient`."""
    import http.client
    import urllib.error
    import urllib.request

    have = partial.stat().st_size if partial.is_file() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return _write_response(response, partial, have, url)
    except urllib.error.HTTPError as error:
        if error.code == 416 and have:  # the range starts at the end: complete already, unless the file changed
            complete = error.headers.get("Content-Range", "").endswith(f"/{have}")
            if complete:
                return have
            partial.unlink()
            raise _Transient("the partial file does not fit the server's file; starting over") from None
        if error.code in RETRIED_STATUSES:
            retry_after = error.headers.get("Retry-After", "")
            raise _Transient(f"HTTP {error.code} {error.reason}",
                             float(retry_after) if retry_after.isdigit() else None) from None
        raise
    except urllib.error.URLError as error:
        if isinstance(error.reason, (TimeoutError, ConnectionError)):
            raise _Transient(first_line(error.reason)) from None
        raise
    except (TimeoutError, ConnectionError, http.client.IncompleteRead) as error:
        raise _Transient(f"the connection broke ({type(error).__name__})") from None


def _write_response(response, partial: Path, have: int, url: str) -> Optional[int]:
    """Write an answer to a (ranged) GET into `partial`: appended for a 206 that starts where it ends, from the start
    for a 200. Returns the full size when the server said it; a short body is a `_Transient` failure."""
    from litgpt.progress import Progress

    length = response.headers.get("Content-Length")
    if response.status == 206:
        start, _, total = response.headers.get("Content-Range", "").removeprefix("bytes ").partition("/")
        if not start.startswith(f"{have}-"):
            partial.unlink()  # the next try starts over
            raise _Transient(f"the server sent the range {start or '?'} for a file of {have} bytes")
        total = int(total) if total.isdigit() else None
    else:  # the whole file: what there was is not kept
        have = 0
        total = int(length) if length is not None else None
    with open(partial, "ab" if have else "wb") as file, Progress(
        total, f"Downloading {url.rsplit('/', 1)[-1]}", unit="B", initial=have
    ) as shown:
        while chunk := response.read(READ_BYTES):
            file.write(chunk)
            shown.update(len(chunk))
        written = file.tell()
    if total is not None and written < total:
        raise _Transient(f"the connection broke after {written} of {total} bytes")
    return total


def _verify_download(url: str, partial: Path, size: Optional[int], sha256: Optional[str], by_hand: str) -> None:
    """A file of the wrong size or hash is removed (a new try starts over) and reported."""
    actual = partial.stat().st_size
    problem = f"{actual} bytes arrived, {size} were expected" if size is not None and actual != size else None
    if problem is None and sha256 is not None:
        from litgpt.io import file_sha256

        digest = file_sha256(partial)
        problem = f"its SHA-256 is {digest}, {sha256} was expected" if digest != sha256.lower() else None
    if problem is not None:
        partial.unlink()
        raise UserError(f"The download of {url} is corrupt: {problem}. Try again, or {by_hand[0].lower()}{by_hand[1:]}")
