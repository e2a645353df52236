"""`lifecycle serve`: a real HTTP server on a free loopback port in front of real ranks."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lifecycle.core.format.events import (
    BuffersAllocated,
    CollectiveStarted,
    RequestFinished,
    RequestStarted,
    Shutdown,
)
from tests.support import BODY, journal_events, serve

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]


def test_health_turns_green_at_ready_and_generate_works_twice(tmp_path: Path) -> None:
    """/health is 503 while the ranks boot and 200 once every rank is ready; /generate runs
    twice with the same checksum, the second without creating staging buffers again;
    /lifecycle folds every rank; SIGTERM stops the ranks and each journals its shutdown."""
    with serve(tmp_path, "--num-ranks", "2", "--calibrate") as served:
        seen = served.wait_for_health(200, within=120)
        assert 503 in seen
        assert served.client.get("/liveness").status_code == 200
        first = served.client.post("/generate", json=BODY)
        second = served.client.post("/generate", json=BODY)
        assert first.status_code == 200, first.text
        assert second.status_code == 200, second.text
        assert first.json()["checksum"] == second.json()["checksum"]
        assert [s["name"] for s in first.json()["stages"]] == ["text_encoder", "dit", "vae"]
        state = served.client.get("/lifecycle").json()
        assert state["healthy"] is True
        assert [r["state"] for r in state["ranks"]] == ["ready", "ready"]
        assert state["ranks"][0]["path"] == [
            "created", "gate-check", "bounded-warm", "probe", "re-warm", "drop-buffers", "ready"
        ]  # fmt: skip
        # After ready a rank's pending collective comes from its heartbeat (every second by
        # default): one taken during the last request may say so until the next.
        deadline = time.monotonic() + 10
        while state["ranks"][0]["pending_collective"] is not None and time.monotonic() < deadline:
            time.sleep(0.2)
            state = served.client.get("/lifecycle").json()
        assert state["ranks"][0]["pending_collective"] is None
        assert served.stop() == 0
    log = (tmp_path / "serve.log").read_text()
    assert f"serving on {served.url} (loopback only)" in log
    events = [e for e in journal_events(served.db) if e.rank == 0]
    requests = [
        e for e in events if isinstance(e.event, RequestStarted) and e.event.source == "http"
    ]
    assert len(requests) == 2
    done = [e for e in events if isinstance(e.event, RequestFinished)]

    def between(start: int, kind: type) -> list:  # type: ignore[type-arg]
        end = next(e.seq for e in done if e.seq > start)
        return [e for e in events if start < e.seq < end and isinstance(e.event, kind)]

    assert between(requests[0].seq, BuffersAllocated), "a new shape creates its buffers"
    assert between(requests[1].seq, BuffersAllocated) == []
    # After ready the collective records stay in the ring: a healthy request journals its
    # start and its finish, which counts its collectives and says how far each group got.
    assert between(requests[1].seq, CollectiveStarted) == []
    finished = next(e.event for e in done if e.seq > requests[1].seq)
    assert isinstance(finished, RequestFinished) and finished.ok
    assert finished.collectives > 0
    assert {m.group for m in finished.groups} == {"ulysses0", "world"}
    assert all(m.started == m.finished >= 0 for m in finished.groups)
    # Only the startup's own collectives (its smoke request included) are in the journal.
    assert not any(
        isinstance(e.event, CollectiveStarted) and e.seq > requests[0].seq for e in events
    )
    # A heartbeat the rank's beat thread wrote as it stopped may follow (a loaded host).
    tail = [e for e in events if e.kind != "heartbeat"][-2:]
    assert isinstance(tail[0].event, Shutdown)
    assert tail[0].event.signal == "SIGTERM"
    assert tail[1].state == "stopped"


def test_bad_requests_are_refused_and_the_server_keeps_serving(tmp_path: Path) -> None:
    """A 10 MB prompt, a shape off the grid, negative or huge sizes, a negative seed, unknown
    fields: each is a 4xx, and a good request afterwards still works."""
    with serve(tmp_path, "--num-ranks", "1") as served:
        served.wait_for_health(200, within=120)
        bad = [
            {**BODY, "prompt": "x" * (10 * 2**20)},
            {**BODY, "width": 250},
            {**BODY, "frames": 8},
            {**BODY, "height": -16},
            {**BODY, "width": 1 << 20},
            {**BODY, "steps": 0},
            {**BODY, "seed": -1},
            {**BODY, "sampler": "euler"},
            {"width": 256},
        ]
        for body in bad:
            response = served.client.post("/generate", json=body)
            assert 400 <= response.status_code < 500, (body.get("prompt", "")[:10], response.text)
        assert served.client.post("/generate", json=BODY).status_code == 200
        assert served.stop() == 0


def test_a_failed_rank_turns_health_503_for_good(tmp_path: Path) -> None:
    """With rank 1 raising in bounded-warm, /health never turns 200: it says failed and
    stays 503, and /lifecycle names the failed rank and its error."""
    with serve(
        tmp_path, "--num-ranks", "2", "--fault", "1:bounded-warm:raise", "--dist-timeout", "3"
    ) as served:
        deadline = time.monotonic() + 90
        status = None
        while time.monotonic() < deadline:
            response = served.get("/health")
            assert response is None or response.status_code == 503
            if response is not None and response.json()["status"] == "failed":
                status = "failed"
                break
            time.sleep(0.1)
        assert status == "failed"
        for _ in range(5):
            response = served.get("/health")
            assert response is not None and response.status_code == 503
            time.sleep(0.2)
        state = served.client.get("/lifecycle").json()
        rank1 = state["ranks"][1]
        assert rank1["state"] == "failed"
        assert rank1["first_error"]["state"] == "bounded-warm"
        assert served.client.post("/generate", json=BODY).status_code == 503
        served.stop()


def test_generate_refuses_numbers_that_are_not_plain_integers_with_422_naming_the_field(
    tmp_path: Path,
) -> None:
    """NaN, infinities, 1e400, floats, bools, strings and out-of-range values in any size
    field of /generate are each a 422 naming that field, and the log gets no traceback (at
    most one line)."""
    with serve(tmp_path, "--num-ranks", "1", "--warmup-mode", "none") as served:
        served.wait_for_health(200, within=120)
        log = tmp_path / "serve.log"
        logged = log.read_text()
        values = (
            "NaN",
            "Infinity",
            "-Infinity",
            "1e400",
            "true",
            "256.0",
            '"256"',
            "-16",
            "100000",
        )
        for field in ("width", "height", "frames", "steps"):
            for value in values:
                body = f'{{"prompt": "a lighthouse", "{field}": {value}}}'
                response = served.client.post(
                    "/generate", content=body, headers={"content-type": "application/json"}
                )
                assert response.status_code == 422, (field, value, response.text)
                (error,) = response.json()["detail"]
                assert error["loc"] == ["body", field], (value, error)
        added = log.read_text().removeprefix(logged)
        assert "Traceback" not in added
        assert len(added.splitlines()) <= 1, added
        assert served.stop() == 0


def test_generate_names_every_invalid_field_in_one_list(tmp_path: Path) -> None:
    """A body with a width the model cannot run (not a multiple of 16), frames it cannot make
    (not 1 + 4k) and steps out of range is one 422 whose detail lists all three fields, each
    with why, in FastAPI's shape; a body whose only fault is the model's gets the same shape."""
    with serve(tmp_path, "--num-ranks", "1", "--warmup-mode", "none") as served:
        served.wait_for_health(200, within=120)
        body = {"prompt": "a lighthouse", "width": 200, "frames": 4, "steps": 0}
        response = served.client.post("/generate", json=body)
        assert response.status_code == 422, response.text
        detail = response.json()["detail"]
        assert sorted(tuple(e["loc"]) for e in detail) == [
            ("body", "frames"),
            ("body", "steps"),
            ("body", "width"),
        ], detail
        assert all(e["msg"] and e["type"] for e in detail)
        model_only = served.client.post("/generate", json={**body, "steps": 4})
        assert model_only.status_code == 422
        assert sorted(e["loc"][1] for e in model_only.json()["detail"]) == ["frames", "width"]
        assert served.stop() == 0


def test_the_first_plain_request_to_a_built_in_model_answers_in_seconds(tmp_path: Path) -> None:
    """`serve` of the built-in tiny-video, then the obvious `{"prompt": "a cat"}`: it runs at
    the bounded warmup's shape (832x480x17) at 8 steps, not the field's 1280x720x81 at 50 that
    calibration probes (minutes on a CPU), and says so in its answer; OpenAI's videos take the
    same defaults."""
    with serve(tmp_path, "--model", "tiny-video", "--warmup-mode", "none") as served:
        served.wait_for_health(200, within=180)
        began = time.monotonic()
        answered = served.client.post("/generate", json={"prompt": "a cat"}, timeout=120)
        took = time.monotonic() - began
        assert answered.status_code == 200, answered.text[:300]
        reply = answered.json()
        shape = (reply["width"], reply["height"], reply["frames"], reply["steps"])
        assert shape == (832, 480, 17, 8), reply
        print(f"tiny-video's plain first request: {took:.2f} s")
        assert served.stop() == 0


def test_request_defaults_are_the_models_own_where_the_operator_set_them() -> None:
    """A built-in preset's request defaults are the bounded shape at 8 steps; a preset whose
    default shape was given on the command line, and any other model, keep their own."""
    import dataclasses

    from lifecycle.core.settings.modelspec import MODEL_PRESETS
    from lifecycle.serve.http.servedranks import request_model

    tiny = MODEL_PRESETS["tiny-video"]
    quick = request_model(tiny)
    assert (quick.default_shape.width, quick.default_shape.height) == (832, 480)
    assert (quick.default_frames, quick.default_steps) == (17, 8)
    assert quick.tokens(quick.default_shape) == tiny.tokens(quick.default_shape)
    given = dataclasses.replace(tiny, default_width=640, default_height=480, default_frames=9)
    assert request_model(given) == given
    other = dataclasses.replace(tiny, name="my-video")
    assert request_model(other) == other
