"""KatoClient against a live service on loopback: answers, caches, offline mode, policies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import warnings

import httpx
import pytest
from client_seed import SEEDED
from kato.kernels import get_operator

from kato_client import (
    GpuNotDetected,
    KatoClient,
    KatoError,
    KatoOfflineWarning,
    KatoUnavailable,
    bucket_shape,
    detect_gpu,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TUNED_4K = SEEDED[0][2]  # softmax 4096x4096 float16 on the H200


def client_for(url: str, tmp_path, **kwargs) -> KatoClient:
    kwargs.setdefault("gpu", "H200")
    return KatoClient(url, cache_dir=tmp_path / "cache", **kwargs)


def test_config_answers_exact_nearest_and_default(live_server, tmp_path):
    spec = get_operator("softmax")
    with client_for(live_server.url, tmp_path) as kato:
        assert kato.config("softmax", (4096, 4096), "float16") == TUNED_4K
        exact = kato.lookup("softmax", (4096, 4096), "float16")
        assert (exact.source, exact.tuned_shape, exact.time_ms) == ("exact", (4096, 4096), 0.020)
        near = kato.lookup("softmax", (8192, 4096), "float16", gpu="NVIDIA H200")
        assert near.source == "nearest" and near.tuned_shape == (4096, 4096)
        assert near.config == TUNED_4K
        other_dtype = kato.lookup("softmax", (4096, 4096), "bfloat16")
        assert other_dtype.source == "default"
        assert other_dtype.config == spec.default_config([4096, 4096], "bfloat16")
    with client_for(live_server.url, tmp_path, policy="exact", disk_cache=False) as kato:
        exact_only = kato.lookup("softmax", (8192, 4096), "float16")
        assert exact_only.source == "default"
        assert exact_only.config == spec.default_config([8192, 4096], "float16")


def test_a_hit_sends_nothing_and_spellings_share_one_answer(live_server, tmp_path):
    with client_for(live_server.url, tmp_path) as kato:
        first = kato.config("softmax", (4096, 4096), "float16")
        assert kato.http_requests == 1
        for _ in range(1000):
            assert kato.config("softmax", (4096, 4096), "float16") is first
        # Other spellings of the same lookup: normalised once, then served from memory.
        assert kato.config("softmax", [4096, 4096], "float16") == first
        assert kato.config("softmax", "4096x4096", "float16", gpu="nvidia h200") == first
        assert kato.http_requests == 1
    assert live_server.requests["GET /v1/configs/softmax"] == 1


def test_rejected_lookup_raises_with_the_services_detail(live_server, tmp_path):
    with client_for(live_server.url, tmp_path) as kato:
        with pytest.raises(KatoError, match="unknown operator") as info:
            kato.config("no_such_op", (8, 8), "float16")
        assert info.value.status == 404
        with pytest.raises(KatoError, match="does not support dtype"):
            kato.config("softmax", (8, 8), "int32")


def test_offline_mode_serves_from_disk_with_the_service_down(live_server, tmp_path):
    with client_for(live_server.url, tmp_path) as kato:
        tuned = kato.config("softmax", (65536, 1024), "float16")
    assert tuned == SEEDED[1][2]
    live_server.stop()
    with httpx.Client() as probe, pytest.raises(httpx.ConnectError):
        probe.get(live_server.url + "/healthz")  # the port is dead now
    # A new client (a restarted process), entry stale: served at once, revalidation fails.
    with client_for(live_server.url, tmp_path, ttl=0.0) as kato:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert kato.config("softmax", (65536, 1024), "float16") == tuned
            assert kato.wait_idle(10)
            # Never looked up before: the operator's default, from the local spec.
            fallback = kato.lookup("softmax", (100, 100), "float16")
        assert fallback.source == "default"
        assert fallback.config == get_operator("softmax").default_config([100, 100], "float16")
        offline = [w for w in caught if issubclass(w.category, KatoOfflineWarning)]
        assert len(offline) == 1, [str(w.message) for w in caught]
        with pytest.raises(KatoUnavailable, match="nothing cached"):
            kato.config("no_such_op", (8, 8), "float16")


def test_dead_port_without_cache_raises_for_unknown_operators(dead_url, tmp_path):
    with client_for(dead_url, tmp_path) as kato, pytest.warns(KatoOfflineWarning):
        assert kato.lookup("softmax", (64, 64), "float32").source == "default"
    with client_for(dead_url, tmp_path / "other") as kato, pytest.raises(KatoUnavailable):
        kato.config("no_such_op", (8, 8), "float16")


_WORKER = """
import json, sys
from kato_client import KatoClient
url, cache, first = sys.argv[1], sys.argv[2], int(sys.argv[3])
with KatoClient(url, gpu="H200", cache_dir=cache) as kato:
    keys = [("softmax", (rows, 4096), "float16") for rows in range(first, first + 20)]
    kato.prefetch(keys)
    print(json.dumps({str(k[1][0]): kato.config(*k) for k in keys}))
"""


def test_two_processes_share_the_disk_cache(live_server, tmp_path):
    cache = tmp_path / "shared-cache"
    env = {**os.environ, "PYTHONPATH": REPO}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, live_server.url, str(cache), str(first)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for first in (1, 21)
    ]
    answers: dict[str, dict] = {}
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        answers.update(json.loads(out))
    assert live_server.requests["POST /v1/configs/batch"] == 2
    live_server.stop()
    # A third process-like client, service down: all 40 answers come from the shared file.
    with KatoClient(live_server.url, gpu="H200", cache_dir=cache) as kato:
        for rows, config in answers.items():
            assert kato.config("softmax", (int(rows), 4096), "float16") == config
        assert kato.http_requests == 0
    # 1x4096 is 12 doublings from the only tuned shape (4096x4096), past the service's nearest
    # limit (KATO_NEAREST_MAX_DISTANCE): its answer is the operator's default.
    assert answers["1"] == get_operator("softmax").default_config([1, 4096], "float16")


def test_a_stale_entry_is_served_then_revalidated_in_the_background(live_server, tmp_path):
    faster = {"BLOCK_SIZE": 256, "VEC": 8, "STRATEGY": 1, "CACHE": 2, "MIN_BLOCKS": 0, "LANES": 32}
    with client_for(live_server.url, tmp_path, ttl=0.3) as kato:
        assert kato.config("softmax", (4096, 4096), "float16") == TUNED_4K
        live_server.set_best((4096, 4096), "float16", faster, 0.015)
        time.sleep(0.35)
        started = time.perf_counter()
        assert kato.config("softmax", (4096, 4096), "float16") == TUNED_4K  # stale, at once
        assert time.perf_counter() - started < 0.05
        for _ in range(100):  # one revalidation, however many hits see the stale entry
            kato.config("softmax", (4096, 4096), "float16")
        assert kato.wait_idle(10)
        assert kato.config("softmax", (4096, 4096), "float16") == faster
        assert kato.lookup("softmax", (4096, 4096), "float16").time_ms == 0.015
    assert live_server.requests["GET /v1/configs/softmax"] == 2
    # The disk cache was updated too: a new client sees the new config without asking.
    with client_for(live_server.url, tmp_path) as kato:
        assert kato.config("softmax", (4096, 4096), "float16") == faster
        assert kato.http_requests == 0


def test_wait_idle_returns_only_once_the_new_answer_is_served(tmp_path, monkeypatch):
    """Seen in CI: wait_idle() returned while the revalidation thread was still storing the
    answer on disk, and the next hit got the old config. A slow disk write makes it certain."""
    answers = iter([dict(TUNED_4K), {**TUNED_4K, "BLOCK_SIZE": 1024}])

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            json={"operator": "softmax", "shape": [4096, 4096], "dtype": "float16",
                  "gpu": "H200", "config": next(answers), "source": "exact",
                  "tuned_shape": [4096, 4096], "time_ms": 0.02},
        )  # fmt: skip

    http = httpx.Client(base_url="http://kato", transport=httpx.MockTransport(handler))
    with client_for("http://kato", tmp_path, ttl=0.0, http=http) as kato:
        assert kato.config("softmax", (4096, 4096), "float16") == TUNED_4K
        disk_put = kato._disk.put

        def slow_put(*args, **kwargs):
            time.sleep(0.2)
            disk_put(*args, **kwargs)

        monkeypatch.setattr(kato._disk, "put", slow_put)
        kato.config("softmax", (4096, 4096), "float16")  # stale: queues the revalidation
        assert kato.wait_idle(10)
        assert kato.config("softmax", (4096, 4096), "float16")["BLOCK_SIZE"] == 1024


def test_bucket_policy_rounds_up_and_checks_the_actual_shape(live_server, tmp_path):
    assert bucket_shape((3000, 4000)) == (4096, 4096)
    assert bucket_shape((1, 2, 5)) == (1, 2, 8)
    with client_for(live_server.url, tmp_path, policy="bucket") as kato:
        assert kato.config("softmax", (3000, 4000), "float16") == TUNED_4K
        answer = kato.lookup("softmax", (3000, 4000), "float16")
        assert (answer.shape, answer.source) == ((4096, 4096), "exact")
        assert kato.config("softmax", (2049, 3912), "float16") == TUNED_4K
        assert kato.http_requests == 1  # one lookup for the whole bucket
        # Softmax's limits only grow with the row, so a bucket's winner fits every shape in it;
        # a reduce_sum row split over blocks does not: pieces of a shorter row can be too small.
        split = {"BLOCK_SIZE": 256, "ROW_THREADS": 0, "VEC": 4, "UNROLL": 2, "SPLIT": 1}
        live_server.set_best((4, 65536), "float32", split, 0.05, operator="reduce_sum")
        reduce_sum = get_operator("reduce_sum")
        assert kato.config("reduce_sum", (4, 60000), "float32") == split
        assert kato.http_requests == 2
        assert reduce_sum.check(split, [3, 40000], "float32") is not None
        odd = kato.lookup("reduce_sum", (3, 40000), "float32")
        assert kato.http_requests == 3  # the bucket's answer, then the actual shape's
        assert odd.shape == (3, 40000) and odd.config != split
        assert reduce_sum.check(odd.config, [3, 40000], "float32") is None


def test_prefetch_sends_one_request_for_many_keys(live_server, tmp_path):
    keys = [("softmax", (rows, 1024), "float16") for rows in (1, 7, 64, 1000, 65536)]
    keys += [("softmax", (4096, 4096), "float16", "H200")]
    keys += [{"operator": "softmax", "shape": [1024, 1024], "dtype": "float32"}]
    with client_for(live_server.url, tmp_path) as kato:
        answers = kato.prefetch(keys)
        assert kato.http_requests == 1
        assert [a.source for a in answers][-3:] == ["exact", "exact", "exact"]
        assert answers[-1].config == SEEDED[2][2]
        for key in keys[:-1]:
            kato.config(*key)
        assert kato.prefetch(keys) == answers  # all fresh: nothing asked
        assert kato.http_requests == 1
    assert live_server.requests["POST /v1/configs/batch"] == 1
    assert live_server.requests["GET /v1/configs/softmax"] == 0
    with client_for(live_server.url, tmp_path, disk_cache=False) as kato:
        with pytest.raises(KatoError, match="2 lookup"):  # one shape out of range among them
            kato.prefetch(keys + [("nope", (8, 8), "float16"), ("softmax", (2**31, 4), "float16")])
        assert kato.config("softmax", (4096, 4096), "float16") == TUNED_4K
        assert kato.http_requests == 1  # the valid lookups of the batch were cached


def test_submit_sends_the_token_and_wait_polls_until_done(tmp_path, monkeypatch):
    seen: list[httpx.Request] = []
    polls = iter(["queued", "running", "done"])
    job = {"id": "ab12", "operator": "softmax", "dtype": "float16", "gpu": "H200"}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.method == "POST":
            return httpx.Response(202, json={**job, "status": "queued"})
        return httpx.Response(200, json={**job, "status": next(polls), "trials_done": 1})

    monkeypatch.setenv("KATO_TOKEN", "s3cret")
    http = httpx.Client(base_url="http://kato", transport=httpx.MockTransport(handler))
    with KatoClient("http://kato", gpu="H200", http=http, disk_cache=False) as kato:
        queued = kato.submit("softmax", (4096, 4096), "float16", budget=50, seed=3)
        assert queued["status"] == "queued"
        body = json.loads(seen[0].content)
        assert body == {"operator": "softmax", "shape": [4096, 4096], "dtype": "float16",
                        "gpu": "H200", "budget": 50, "seed": 3}  # fmt: skip
        assert seen[0].headers["Authorization"] == "Bearer s3cret"
        assert kato.wait("ab12", timeout=5, poll_s=0.01)["status"] == "done"
        assert len(seen) == 4
        kato.submit("softmax", (8, 8), "float16", token="other")
        assert seen[-1].headers["Authorization"] == "Bearer other"


def test_submit_errors_are_clear(tmp_path):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"detail": "missing bearer token"})

    http = httpx.Client(base_url="http://kato", transport=httpx.MockTransport(handler))
    with KatoClient("http://kato", gpu="H200", http=http, disk_cache=False) as kato:
        with pytest.raises(KatoError, match="missing bearer token.*KATO_TOKEN") as info:
            kato.submit("softmax", (8, 8), "float16")
        assert info.value.status == 401
        with pytest.raises(TimeoutError):
            KatoClient(
                "http://kato",
                gpu="H200",
                disk_cache=False,
                http=httpx.Client(
                    base_url="http://kato",
                    transport=httpx.MockTransport(
                        lambda r: httpx.Response(200, json={"status": "running"})
                    ),
                ),
            ).wait("x", timeout=0.05, poll_s=0.01)


def test_gpu_detection_order_and_error(monkeypatch, tmp_path):
    assert detect_gpu((lambda: None, lambda: "NVIDIA H200", lambda: "Tesla T4")) == "H200"
    assert detect_gpu((lambda: "NVIDIA GeForce RTX 3080",)) == "RTX 3080"
    with pytest.raises(GpuNotDetected, match="pass gpu='H200'"):
        detect_gpu((lambda: None,))
    monkeypatch.setenv("KATO_GPU", "NVIDIA A100-SXM4-80GB")
    kato = KatoClient("http://127.0.0.1:9", disk_cache=False)
    assert kato.gpu == detect_gpu() == "A100 80GB"
    kato.close()


def test_threads_share_one_client(live_server, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    keys = [("softmax", (rows, 1024), "float16") for rows in range(1, 41)]
    with client_for(live_server.url, tmp_path, ttl=0.05) as kato:
        expected = {k: kato.lookup(*k).config for k in keys}

        def hammer(offset: int) -> bool:
            for i in range(400):
                key = keys[(i + offset) % len(keys)]
                if kato.config(*key) != expected[key]:
                    return False
            return True

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(hammer, range(8)))
        assert kato.wait_idle(10)
    # Stale entries were revalidated in the background, one request per key at a time at most.
    assert live_server.requests["GET /v1/configs/softmax"] >= len(keys)


def test_after_invalidate_the_next_lookup_skips_the_services_cache(live_server, tmp_path):
    """A job's winner is in the database before the job reads ``done``, but the service's own
    answer cache drops the old answer only on its watcher's next check: the lookups that
    follow ``wait()`` (which calls ``invalidate``) must not be answered from it, or the client
    would keep the old config for its whole ``ttl``."""
    faster = {"BLOCK_SIZE": 256, "VEC": 8, "STRATEGY": 1, "CACHE": 2, "MIN_BLOCKS": 0, "LANES": 32}
    with client_for(live_server.url, tmp_path) as kato:
        assert kato.config("softmax", (4096, 4096), "float16") == TUNED_4K
        # The service's cache still holds the old answer (its watcher has not run).
        live_server.set_best((4096, 4096), "float16", faster, 0.015, drop_cache=False)
        kato.invalidate("softmax", "float16")
        assert kato.config("softmax", (4096, 4096), "float16") == faster
    with client_for(live_server.url, tmp_path) as kato:  # the disk cache has it too
        assert kato.config("softmax", (4096, 4096), "float16") == faster
        assert kato.http_requests == 0


def test_a_revalidation_overtaken_by_invalidate_is_not_stored(tmp_path):
    """A background revalidation that asked before ``invalidate`` may carry the old answer:
    it must not be written back to the caches after them."""
    old, new = dict(TUNED_4K), {**TUNED_4K, "BLOCK_SIZE": 1024}
    asked, release = threading.Event(), threading.Event()
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 2:  # the revalidation: held until invalidate() has run
            asked.set()
            release.wait(10)
        config = new if len(calls) == 3 else old
        return httpx.Response(
            200,
            json={"operator": "softmax", "shape": [4096, 4096], "dtype": "float16",
                  "gpu": "H200", "config": config, "source": "exact",
                  "tuned_shape": [4096, 4096], "time_ms": 0.02},
        )  # fmt: skip

    http = httpx.Client(base_url="http://kato", transport=httpx.MockTransport(handler))
    with client_for("http://kato", tmp_path, ttl=0.0, http=http) as kato:
        assert kato.config("softmax", (4096, 4096), "float16") == old
        kato.config("softmax", (4096, 4096), "float16")  # stale: queues the revalidation
        assert asked.wait(10)
        kato.invalidate("softmax", "float16")
        release.set()
        assert kato.wait_idle(10)
        assert kato.config("softmax", (4096, 4096), "float16") == new
        assert len(calls) == 3
        assert calls[2].headers.get("Cache-Control") == "no-cache"


def test_lookups_carry_the_services_figures_through_both_caches(live_server, tmp_path):
    """default_ms, framework_ms, framework and speedup (compiled_ms, compiled and
    compiled_speedup too) as the service answered them (a nearest answer's are its
    neighbour's), kept by the disk cache for a new process offline; an offline default has
    none."""
    from kato.db import queries

    with live_server.app.state.session_factory() as session:
        queries.upsert_best_config(
            session, operator="softmax", operator_version=get_operator("softmax").version,
            shape=[2048, 2048], dtype="float16", gpu_model="H200", compute_capability="9.0",
            cuda_version="13.0", config=TUNED_4K, time_ms=0.025, job_id=None, default_ms=0.04,
            framework_ms=0.05, framework="torch 2.13.0+cu130", compiled_ms=0.03,
            compiled="torch.compile 2.14.1 inductor",
        )  # fmt: skip
    with client_for(live_server.url, tmp_path) as kato:
        got = kato.lookup("softmax", (2048, 2048), "float16")
        assert (got.compiled_ms, got.compiled) == (0.03, "torch.compile 2.14.1 inductor")
        assert got.compiled_speedup == pytest.approx(1.2)
        assert (got.default_ms, got.framework_ms, got.framework) == (
            0.04, 0.05, "torch 2.13.0+cu130",
        )  # fmt: skip
        assert got.speedup == pytest.approx(2.0)
        near = kato.lookup("softmax", (2048, 1024), "float16")
        assert (near.source, near.tuned_shape, near.speedup) == (
            "nearest",
            (2048, 2048),
            got.speedup,
        )
    live_server.stop()
    with client_for(live_server.url, tmp_path, ttl=0.0) as kato, warnings.catch_warnings():
        warnings.simplefilter("ignore", KatoOfflineWarning)
        again = kato.lookup("softmax", (2048, 2048), "float16")
        fallback = kato.lookup("softmax", (100, 100), "float16")
        kato.wait_idle(10)
    assert (again.framework_ms, again.framework, again.speedup) == (
        0.05, "torch 2.13.0+cu130", got.speedup,
    )  # fmt: skip
    assert (again.compiled_ms, again.compiled_speedup) == (0.03, got.compiled_speedup)
    assert fallback.source == "default"
    figures = (fallback.default_ms, fallback.framework_ms, fallback.framework, fallback.speedup)
    assert figures == (None, None, None, None)
    assert (fallback.compiled_ms, fallback.compiled, fallback.compiled_speedup) == (None,) * 3


def test_an_answer_without_figures_reads_as_unmeasured():
    """A service older than the figures answers without them: the Lookup says None."""
    from kato_client.client import Lookup

    answer = {"operator": "softmax", "shape": [8, 8], "dtype": "float16", "gpu": "H200",
              "config": {}, "source": "exact", "tuned_shape": [8, 8], "time_ms": 0.01}  # fmt: skip
    old = Lookup.from_answer(answer, 1.0)
    assert (old.default_ms, old.framework_ms, old.framework, old.speedup) == (None,) * 4
    assert (old.compiled_ms, old.compiled, old.compiled_speedup) == (None,) * 3
    computed = Lookup.from_answer({**answer, "framework_ms": 0.02, "compiled_ms": 0.015}, 1.0)
    assert computed.speedup == pytest.approx(2.0)
    assert computed.compiled_speedup == pytest.approx(1.5)


def test_submit_batch_queues_every_job_or_none(live_server):
    from kato.db import tokens

    with live_server.app.state.session_factory() as session:
        secret = tokens.create_token(session, "batch")[1]
    with KatoClient(live_server.url, gpu="H200", token=secret, disk_cache=False) as kato:
        jobs = kato.submit_batch(
            [
                {"operator": "softmax", "shape": (64, 1024), "dtype": "float16"},
                {"operator": "layernorm", "shape": [8, 768], "dtype": "bfloat16", "budget": 9},
            ],
            budget=20,
        )
        assert [(j["operator"], j["status"], j["budget"]) for j in jobs] == [
            ("softmax", "queued", 20),
            ("layernorm", "queued", 9),
        ]
        with pytest.raises(KatoError, match=r"jobs\[1\]") as info:
            kato.submit_batch(
                [
                    {"operator": "softmax", "shape": (64, 1024), "dtype": "float16"},
                    {"operator": "softmax", "shape": (64, 1024), "dtype": "int8"},
                ]
            )
        assert info.value.status == 422
        assert len(kato.submit_batch([])) == 0
    assert live_server.requests["POST /v1/jobs/batch"] == 2
