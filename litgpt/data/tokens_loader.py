"""litdata's `TokensLoader` with its open-chunk bookkeeping kept by one thread at a time.

When a folder is read through a cache (`s3://`, `local:`, ...), litdata's prefetch thread opens the chunks it fetched
and deletes the ones read to the end, while the reading thread opens and closes the same chunks. Both check, then
change, the loader's dicts of open chunks, so a thread switch between the check and the change fails the reader with
a `KeyError` at a chunk boundary (seen on a loaded two-node run). One lock around the three methods that change them
makes each whole. Imported only when a folder is streamed: it imports litdata.
"""

from __future__ import annotations

import threading

import litdata


class TokensLoader(litdata.TokensLoader):  # litdata checks a folder's loader by class name: it keeps litdata's
    def __init__(self, block_size: int | None = None):
        super().__init__(block_size)
        self._open_chunks_lock = threading.RLock()

    def _load_chunk(self, chunk_index: int, chunk_filepath: str) -> None:
        with self._open_chunks_lock:
            super()._load_chunk(chunk_index, chunk_filepath)

    def close(self, chunk_index: int) -> None:
        with self._open_chunks_lock:
            super().close(chunk_index)

    def delete(self, chunk_index: int, chunk_filepath: str) -> None:
        with self._open_chunks_lock:
            super().delete(chunk_index, chunk_filepath)

    # A lock cannot be pickled: loader workers started by spawn or forkserver get a new one.
    def __getstate__(self) -> dict:
        state = super().__getstate__()
        del state["_open_chunks_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open_chunks_lock = threading.RLock()
