"""The video jobs outlive their server: the queue is bounded (429 with Retry-After past
--max-queued-jobs), a job running or waiting when the server stops reads failed, with why, after
a restart on the same journal, and a job completed before is still served."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.support import serve
from tests.support.families import QUICK
from tests.support.openaisdk import SORA_WARNING, sdk_client, timed, wait_until

pytestmark = [
    pytest.mark.ranks,
    pytest.mark.filterwarnings(SORA_WARNING),
    pytest.mark.usefixtures("no_leftover_processes"),
]

SERVE = ("--model", "tiny-wan", *QUICK, "--max-queued-jobs", "1")
QUICK_VIDEO = {"num_frames": 9, "num_inference_steps": 3, "seed": 3}
LONG_VIDEO = {"num_frames": 9, "num_inference_steps": 200}


def test_jobs_stopped_with_the_server_read_failed_and_completed_ones_are_served_after_a_restart(
    tmp_path: Path,
) -> None:
    """With one job allowed to wait, a third is a 429 (the SDK's RateLimitError) with
    Retry-After; SIGTERM while one job runs and one waits; served again on the same journal,
    both read failed (server_stopped, naming the signal), and the mp4 of the job completed
    before the stop is the same bytes."""
    with serve(tmp_path, *SERVE) as server:
        server.wait_for_health(200, within=240)
        with sdk_client(server) as client:
            done = client.videos.create_and_poll(
                prompt="a cat", size="48x32", extra_body=QUICK_VIDEO
            )
            assert done.status == "completed", done
            before = client.videos.download_content(done.id).read()
            running = client.videos.create(prompt="a long one", size="48x32", extra_body=LONG_VIDEO)
            waiting = client.videos.create(prompt="behind it", size="48x32", extra_body=QUICK_VIDEO)
            with pytest.raises(openai.RateLimitError) as refused:
                timed(
                    "videos.create (queue full)",
                    lambda: client.videos.create(prompt="one too many", size="48x32"),
                )
            assert refused.value.status_code == 429 and refused.value.code == "queue_full"
            assert int(refused.value.response.headers["Retry-After"]) > 0
            wait_until(client, running.id, lambda v: v.status == "in_progress", within=240)
        assert server.stop() == 0
    assert (tmp_path / "j.db.jobs").is_dir()
    with serve(tmp_path, *SERVE) as again:
        again.wait_for_health(200, within=240)
        with sdk_client(again) as client:
            for job in (running, waiting):
                stopped = timed(
                    "videos.retrieve (after restart)", lambda j=job: client.videos.retrieve(j.id)
                )
                assert stopped.status == "failed", stopped
                assert stopped.error is not None and stopped.error.code == "server_stopped"
                assert "SIGTERM" in stopped.error.message
            kept = client.videos.retrieve(done.id)
            assert kept.status == "completed"
            after = timed(
                "videos.download_content (after restart)",
                lambda: client.videos.download_content(done.id).read(),
            )
            assert after == before
            with pytest.raises(openai.NotFoundError) as gone:
                client.videos.download_content(running.id)
            assert gone.value.code == "job_failed"
        assert again.stop() == 0


def test_a_job_whose_rank_failed_reads_failed_with_the_culprit_and_the_command(
    tmp_path: Path,
) -> None:
    """A rank that raises in a job's request (the fault `0:request:raise`): the job reads
    failed, code rank_failed, its error naming the rank and the `replay diagnose` command that
    explains it; its content is a 404 saying it failed."""
    with serve(tmp_path, "--model", "micro-video", *QUICK, "--fault", "0:request:raise") as server:
        server.wait_for_health(200, within=240)
        with sdk_client(server) as client:
            failed = client.videos.create_and_poll(
                prompt="a cat", size="128x128", extra_body={"num_frames": 5, "seed": 1}
            )
            assert failed.status == "failed", failed
            assert failed.error is not None and failed.error.code == "rank_failed"
            assert "rank 0" in failed.error.message
            assert "replay diagnose" in failed.error.message, failed.error.message
            with pytest.raises(openai.NotFoundError) as gone:
                client.videos.download_content(failed.id)
            assert gone.value.code == "job_failed"
        assert server.stop() == 0  # the request failed alone: the server went on
