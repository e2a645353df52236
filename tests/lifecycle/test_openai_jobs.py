"""The jobs of the OpenAI-compatible API kept on disk: where the folder is and its mode, each
job's JSON file beside its content, a job left unfinished failed at the next start, and the
content kept for --job-ttl and under --max-job-bytes, oldest removed first."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from lifecycle.serve.openai.jobs import QUEUED, Job, JobError, JobStore, jobs_folder


class Clock:
    """A wall clock a test moves by hand."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def job(job_id: str, *, created_at: int = 1_000_000) -> Job:
    return Job(
        id=job_id, kind="video", status=QUEUED, created_at=created_at, model="tiny-wan",
        prompt="a cat", size="48x32", num_frames=9, fps=16, num_inference_steps=3, seed=0,
    )  # fmt: skip


def test_the_folder_is_beside_a_journal_file_else_under_the_current_one(tmp_path: Path) -> None:
    """A journal file's jobs are kept in JOURNAL.jobs; a database URL's in ./jobs; --jobs-dir
    wins over both."""
    assert jobs_folder(str(tmp_path / "j.db"), None) == tmp_path / "j.db.jobs"
    assert jobs_folder(f"sqlite:///{tmp_path}/j.db", None) == tmp_path / "j.db.jobs"
    assert jobs_folder("postgresql://db/journal", None) == Path("jobs").resolve()
    assert jobs_folder(str(tmp_path / "j.db"), str(tmp_path / "else")) == tmp_path / "else"


def test_a_job_is_a_json_file_in_a_folder_only_its_owner_reads(tmp_path: Path) -> None:
    """The folder is mode 0700 and the job's JSON (0600) says what the store says; its mp4 is
    written beside it before the record says completed, and no temporary file is left."""
    store = JobStore(folder=tmp_path / "j.db.jobs", clock=Clock())
    store.open()
    store.put(job("video_a"))
    store.finish("video_a", content=b"mp4 bytes", inference_time_s=1.5, peak_memory_mb=12.0)
    assert stat.S_IMODE(store.folder.stat().st_mode) == 0o700
    record = store.folder / "video_a.json"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    doc = json.loads(record.read_text())
    assert (doc["status"], doc["progress"], doc["content_bytes"]) == ("completed", 100, 9)
    assert doc["expires_at"] == 1_000_000 + 3600
    assert (store.folder / "video_a.mp4").read_bytes() == b"mp4 bytes"
    assert sorted(p.name for p in store.folder.iterdir()) == ["video_a.json", "video_a.mp4"]


def test_a_job_left_unfinished_is_failed_at_the_next_start(tmp_path: Path) -> None:
    """A job a killed server left queued or in progress reads failed (server_stopped) once the
    store is opened again; a completed one is served on."""
    folder = tmp_path / "jobs"
    first = JobStore(folder=folder, clock=Clock())
    first.open()
    first.put(job("video_done"))
    first.finish("video_done", content=b"x")
    first.put(job("video_left"))
    first.update("video_left", status="in_progress")
    again = JobStore(folder=folder, clock=Clock())
    assert [j.id for j in again.open()] == ["video_left"]
    left = again.get("video_left")
    assert left is not None and left.status == "failed"
    assert left.error is not None and left.error.code == "server_stopped"
    done = again.get("video_done")
    assert done is not None and done.status == "completed"
    assert again.content_path(done).read_bytes() == b"x"


def test_content_expires_after_the_ttl_and_the_record_one_ttl_later(tmp_path: Path) -> None:
    """At expires_at the mp4 is removed and the record says why; one TTL later the record
    goes too."""
    clock = Clock()
    store = JobStore(folder=tmp_path / "jobs", ttl_s=100, clock=clock)
    store.open()
    store.put(job("video_a"))
    store.finish("video_a", content=b"x")
    clock.now += 100
    store.prune()
    expired = store.get("video_a")
    assert expired is not None and expired.expired is not None and "expired" in expired.expired
    assert not (store.folder / "video_a.mp4").exists()
    clock.now += 100
    store.prune()
    assert store.get("video_a") is None
    assert list(store.folder.iterdir()) == []


def test_past_the_byte_cap_the_oldest_finished_content_goes_first(tmp_path: Path) -> None:
    """With 10 bytes allowed, three 4-byte results keep the two newest; a failed job holds
    nothing and is untouched."""
    clock = Clock()
    store = JobStore(folder=tmp_path / "jobs", max_bytes=10, clock=clock)
    store.open()
    for name in ("video_1", "video_2", "video_3"):
        store.put(job(name))
        store.finish(name, content=b"1234")
        clock.now += 1
    store.put(job("video_f"))
    store.finish("video_f", error=JobError(code="rank_failed", message="rank 0 failed"))
    store.prune()
    kept = {j.id: j.expired for j in store.listed("video")}
    assert kept["video_1"] is not None and "--max-job-bytes" in kept["video_1"]
    assert (kept["video_2"], kept["video_3"], kept["video_f"]) == (None, None, None)
    assert sorted(p.name for p in store.folder.glob("*.mp4")) == ["video_2.mp4", "video_3.mp4"]
