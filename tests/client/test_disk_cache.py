"""kato_client.disk: one cache file shared by processes, created by whichever comes first."""

from __future__ import annotations

import threading

from kato_client.disk import DiskCache

ANSWER = {"operator": "softmax", "dtype": "float16", "gpu": "H200"}


def test_connections_opening_a_new_cache_at_once_all_keep_their_answers(tmp_path):
    """Processes (here: threads with their own connections, the same SQLite locking) race to
    create the file and switch it to WAL; SQLite answers the losers "database is locked" at
    once. Seen in CI: one of two training processes lost its whole disk cache that way."""
    for attempt in range(100):  # the race is in the first milliseconds of a file: run it often
        caches = [DiskCache(tmp_path / f"cache{attempt}", "http://kato") for _ in range(4)]
        barrier = threading.Barrier(len(caches))

        def write(cache: DiskCache, name: int, barrier: threading.Barrier) -> None:
            barrier.wait()
            for i in range(5):
                cache.put(f"{name}-{i}", ANSWER, float(i))

        threads = [
            threading.Thread(target=write, args=(c, n, barrier)) for n, c in enumerate(caches)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(cache._broken for cache in caches), f"attempt {attempt}"
        for name in range(len(caches)):
            for i in range(5):
                assert caches[0].get(f"{name}-{i}") == (ANSWER, float(i))
        for cache in caches:
            cache.close()


def test_a_newer_answer_is_never_replaced_by_an_older_one(tmp_path):
    cache = DiskCache(tmp_path, "http://kato")
    cache.put("k", {"operator": "softmax", "v": 2}, 20.0)
    cache.put("k", {"operator": "softmax", "v": 1}, 10.0)
    assert cache.get("k") == ({"operator": "softmax", "v": 2}, 20.0)
    cache.put("k", {"operator": "softmax", "v": 3}, 30.0)
    assert cache.get("k") == ({"operator": "softmax", "v": 3}, 30.0)


def test_an_unusable_directory_makes_an_empty_cache_not_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cache = DiskCache(blocker / "sub", "http://kato")
    cache.put("k", {"operator": "softmax"}, 1.0)  # logged once, then ignored
    assert cache.get("k") is None
    assert cache._broken
