"""What `lifecycle serve` knows and does behind its endpoints: the ranks' folded journal, their
health, and one request at a time sent to every rank."""

from __future__ import annotations

import contextlib
import shlex
import threading
import time
from collections.abc import Iterator
from typing import Any

from lifecycle.core.decisions.requesttime import DEFAULT_REQUEST_TIMEOUT_S, TimeBound
from lifecycle.core.format.events import StoredEvent
from lifecycle.core.format.records import Generation
from lifecycle.core.format.view import RankView
from lifecycle.core.requestid import request_id_of
from lifecycle.core.settings.config import ServerArgs
from lifecycle.serve.console.progress import ProgressPrinter
from lifecycle.serve.console.steps import StepMark
from lifecycle.serve.console.terminal import PlainConsole
from lifecycle.serve.http.bounds import RequestBounds
from lifecycle.serve.http.failure import RunFailure
from lifecycle.serve.http.metrics import JournalMetrics
from lifecycle.serve.http.rankjson import rank_checks_json, ranks_json, straggler_json
from lifecycle.serve.http.requestline import RequestLine
from lifecycle.serve.http.restarts import Relaunch, Restarts, replace_ranks
from lifecycle.serve.http.servedranks import Ranks, Reply, request_model
from lifecycle.serve.keeper.resting import AWAKE, Resting
from lifecycle.serve.logs import say
from lifecycle.serve.ranks.cancel import wait_within
from lifecycle.serve.ranks.control import ControlChannel, RankLink, ServiceUnavailable
from lifecycle.serve.ranks.inflight import RequestFailed, RequestInFlight
from lifecycle.serve.ranks.messages import Generate, GivenUp, Result
from lifecycle.serve.ranks.supervisor import POLL_S
from lifecycle.store import shown_location
from lifecycle.verdict.launched import LaunchedRun, exit_text


class Service:
    """What the endpoints read and do: the ranks, their folded journal, their control links;
    with `relaunch`, ranks started anew in place of a group a request failed in."""

    def __init__(
        self,
        args: ServerArgs,
        group: Ranks,
        control: ControlChannel,
        *,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        relaunch: Relaunch | None = None,
        max_restarts: int = 0,
    ) -> None:
        self.args = args
        self.group = group
        self.control = control
        self.request_timeout_s = request_timeout_s
        # The model as a request's defaults see it (a built-in's are small: seconds on a CPU).
        self.request_model = request_model(args.model)
        self.views: dict[int, RankView] = {}
        self.exit_codes: list[int | None] = []
        self.steps: dict[int, StepMark] = {}  # each rank's latest denoising step
        self.stopping: str | None = None
        self._lock = threading.Lock()  # the fields above; never held across a request
        self.line = RequestLine()  # /generate: the request running and those waiting
        self._stop = threading.Event()
        # Held while the journal is followed, and while the ranks are replaced.
        self._following = threading.Lock()
        self.restarts = Restarts(relaunch=relaunch, allowed=max_restarts)
        self.resting = Resting()  # POST /sleep, /wake (serve.keeper.sleepwake)
        self.metrics = JournalMetrics(
            views=self.views_now,
            ended=self.ended_ranks,
            created_at=group.created_at,
            hosts=self._hosts,
            lost=self._lost,
            rejected=self._rejected,
        )
        self._new_run(group)
        self.bounds = RequestBounds(args)

    # What /metrics reads of the ranks, from whichever group serves when it is scraped.
    def _hosts(self) -> dict[int, str]:
        return self.group.hosts()

    def _lost(self) -> set[int]:
        return set(self.group.lost())

    def _rejected(self) -> dict[tuple[int, str], int]:
        return self.control.rejected()

    def _new_run(self, group: Ranks) -> None:
        """What is kept of one group of ranks: its console and its failure."""
        self.printer = ProgressPrinter(run_created_at=group.created_at, ranks=self.args.num_ranks)
        self.console = PlainConsole(self.printer)
        self.metrics.created_at = group.created_at
        self.run_failure = RunFailure(
            LaunchedRun.of(self.args, run_id=group.run_id, created_at=group.created_at)
        )

    @property
    def failed(self) -> bool:
        """The ranks failed for good (not while they are being replaced)."""
        return self.failure is not None and self.restarts.pending is None

    @property
    def failure(self) -> str | None:
        """Why the ranks failed: the first sign, then the run's verdict."""
        return self.run_failure.reason

    @property
    def failed_at(self) -> float | None:
        """When the ranks failed for good (monotonic); None while they are being replaced."""
        return None if self.restarts.pending is not None else self.run_failure.at

    def follow(self) -> None:
        """Fold the journal every poll interval until told to stop; once the ranks failed and
        their ends settled, say why, as the run's verdict names its culprit."""
        while not self._stop.is_set():
            with self._following:
                self._follow_once()
            self._stop.wait(POLL_S)
        if self.failed and not self.run_failure.judged:  # stopped before the ends settled
            self._judge(self.views_now(), list(self.exit_codes))

    def _follow_once(self) -> None:
        """One poll of the ranks: fold their new events, and fail or judge the run."""
        # The exit statuses first: a rank that had ended by then has committed everything
        # it will, and the poll after reads it, so that a rank that journaled its end is
        # never shown as one that ended without it.
        codes = self.group.exit_codes()
        events = self.group.poll()
        self.group.announce_ended()
        self._print(events)
        self.metrics.feed(events)
        views = self.group.views()
        steps = self.group.steps()
        self.console.steps(steps)
        with self._lock:
            self.views, self.exit_codes, self.steps = views, codes, steps
        failed = [v for v in views.values() if v.state == "failed"]
        if failed:
            self.fail(f"rank {failed[0].rank} failed")
        self._check_ranks()
        if self.run_failure.settled(codes, self.group.lost()):
            # Judged and printed here, not where the failure is seen: the probes must not
            # wait on the verdict or on I/O.
            self._judge(views, codes)

    def _judge(self, views: dict[int, RankView], codes: list[int | None]) -> None:
        why = self.run_failure.judge(views, codes, self.group.lost())
        say(f"failed: {why}", event="serve-failed", why=why)

    def _print(self, events: list[StoredEvent]) -> None:
        for stored in events:
            self.console.feed(stored)

    def views_now(self) -> dict[int, RankView]:
        with self._lock:
            return dict(self.views)

    def ended_ranks(self) -> set[int]:
        """The ranks whose process has ended, as of the last poll."""
        with self._lock:
            return {rank for rank, code in enumerate(self.exit_codes) if code is not None}

    def stop_following(self) -> None:
        self._stop.set()

    def fail(self, reason: str) -> None:
        """Mark the ranks failed for good (the first reason is kept, until the run's verdict
        names the culprit); refuse waiting requests."""
        if not self.run_failure.seen(reason):
            return
        self.line.wake()

    def begin_stop(self, reason: str) -> None:
        """Refuse new requests and answer the running and waiting ones: the server stops."""
        with self._lock:
            if self.stopping is None:
                self.stopping = reason
        self.line.wake()
        running = self.line.running()
        if running is not None:
            running.abandon(f"server stopping ({reason})")

    def ranks_to_stop(self) -> tuple[Ranks, ControlChannel]:
        """The ranks and control channel to stop once the server stops (after begin_stop): a
        restart under way is over first, with new ranks started or not."""
        with self._following:
            return self.group, self.control

    def _restart(self) -> None:
        replace_ranks(self)

    def swap(self, group: Ranks, control: ControlChannel) -> None:
        """Serve with a new group of ranks (a restart), its run's console and failure anew."""
        with self._lock:
            self.group, self.control = group, control
            self.views, self.exit_codes, self.steps = {}, [], {}
        self._new_run(group)

    @contextlib.contextmanager
    def following_paused(self) -> Iterator[None]:
        """No poll of the ranks while this holds (the ranks are being replaced)."""
        with self._following:
            yield

    def wake_line(self) -> None:
        self.line.wake()

    def catch_up(self) -> None:
        """Fold what the ranks journaled until now (after a sleep or a wake)."""
        with self._following:
            self._follow_once()

    def settle(self) -> None:
        """The ranks' last events folded, and their run judged if it failed."""
        self._follow_once()
        if self.run_failure.reason is not None and not self.run_failure.judged:
            self._judge(self.views_now(), list(self.exit_codes))

    def _check_ranks(self) -> None:
        """A rank process that ended, or whose control connection closed, while the server
        was not stopping has failed, whatever its journal last said (SIGKILL leaves nothing)."""
        if self.stopping is not None or self.failure is not None:
            return
        if self.restarts.pending is not None:
            return
        for rank, why in sorted(self.group.lost().items()):
            self.fail(f"rank {rank} lost: {why}")
            return
        for rank, code in enumerate(self.group.exit_codes()):
            if code is not None:
                self.fail(f"rank {rank} process ended: {exit_text(code)}")
                return
        for rank, link in sorted(self.control.snapshot().items()):
            if not link.alive:
                self.fail(f"rank {rank} {link.gone}")
                return

    def dump(self) -> list[int]:
        """Ask every rank to write its collective ring to the journal; the ranks asked."""
        return self.control.dump("http")

    def health(self) -> tuple[bool, str]:
        self._check_ranks()
        with self._lock:
            if self.stopping is not None:
                return False, "stopping"
            if self.restarts.pending is not None:
                return False, "restarting"
            if self.failure is not None:
                return False, "failed"
            if self.resting.state != AWAKE:
                return False, self.resting.state
            views = self.views
        links = self.control.snapshot()
        ready = (
            len(views) == self.args.num_ranks
            and all(v.healthy for v in views.values())
            and len(links) == self.args.num_ranks
            and all(link.ready.is_set() and link.alive for link in links.values())
        )
        return ready, "ready" if ready else "starting"

    def lifecycle(self) -> dict[str, Any]:
        now = time.time()
        healthy, status = self.health()
        with self._lock:
            views = dict(self.views)
            codes = list(self.exit_codes)
            failure = self.failure
            steps = dict(self.steps)
        hosts = self.group.hosts()
        lost = self.group.lost()
        return {
            "run_id": self.group.run_id,
            # ORG/NAME@COMMIT for a model by hub ID, and the snapshot folder its ranks load.
            "model": {"name": self.args.model.name, "source": self.args.model.source},
            "status": status,
            "healthy": healthy,
            "failure": failure,
            "store": {
                "authenticated": self.group.store_authenticated,
                "rejected": sum(self.control.rejected().values()),
            },
            "ranks": ranks_json(views, codes=codes, steps=steps, hosts=hosts, lost=lost, now=now),
            "straggler": straggler_json(views),
            "rank_checks": rank_checks_json(views),
            "admission": self.bounds.describe(views),
            "restarts": self.restarts.describe(),
        }

    def _refusal(self) -> ServiceUnavailable | None:
        """Why a request waiting in line is refused now; None while it may wait (a restart
        under way included)."""
        if self.resting.state != AWAKE:
            state = self.resting.state
            return ServiceUnavailable(status=state, detail=f"{state}: POST /wake to serve again")
        return self.stopping_or_failed()

    def stopping_or_failed(self) -> ServiceUnavailable | None:
        """Why anything waiting in line (a sleep or wake too) is refused now."""
        with self._lock:
            if self.restarts.pending is not None and self.stopping is None:
                return None
            if self.failure is not None:
                return ServiceUnavailable(status="failed", detail=f"failed: {self.failure}")
            if self.stopping is not None:
                return ServiceUnavailable(
                    status="stopping", detail=f"server stopping ({self.stopping})"
                )
        return None

    def failed_request(self, exc: RequestFailed) -> dict[str, Any]:
        """A failed request's answer: the culprit rank and its error, the ranks that failed
        waiting on it, and the command that explains the run."""
        journal = shlex.quote(shown_location(self.args.db))
        run_id = exc.run_id or self.group.run_id
        return exc.answer(diagnose=f"replay diagnose {run_id} {journal}")

    def queue_depth(self) -> int:
        """The requests running or waiting for the ranks."""
        return self.line.depth()

    def place_in_line(self) -> contextlib.AbstractContextManager[None]:
        """Hold a place among the requests running or waiting; refuse at once when the line
        is full."""
        return self.line.place()

    def generate(
        self,
        request: Generation,
        *,
        request_id: str | None = None,
        return_video: bool = False,
        traceparent: str | None = None,
    ) -> Reply:
        """Run one request on every rank once the one running now is done, under
        `request_id` (a new one when None), within its time bound (RequestPastDeadline past
        it) unless withdrawn first (RequestWithdrawn); rank 0's result (it decodes) is the
        answer. `traceparent` is the server's span of it, which the ranks' spans join."""
        named = request_id_of(request_id)
        with self.line.named(named):
            running, links = self.line.turn(
                named,
                steps=request.steps,
                held=lambda: self.restarts.pending is not None,
                refusal=self._refusal,
                links=self.control.snapshot,
            )
            return self._generate(
                request,
                running=running,
                links=links,
                return_video=return_video,
                traceparent=traceparent,
            )

    def _generate(
        self,
        request: Generation,
        *,
        running: RequestInFlight,
        links: dict[int, RankLink],
        return_video: bool,
        traceparent: str | None,
    ) -> Reply:
        try:
            message = Generate(
                request_id=running.request_id,
                request=request,
                return_video=return_video,
                traceparent=traceparent,
            )
            prediction = self.bounds.prediction(self.views_now(), request)
            bound = TimeBound.of(prediction, limit_s=self.request_timeout_s)
            replies = self._run(running, links, message, bound)
            self.bounds.served(request, replies)
        finally:
            self.line.done()
        return Reply.of(running.request_id, request, replies[0])

    def _run(
        self,
        request: RequestInFlight,
        links: dict[int, RankLink],
        message: Generate,
        bound: TimeBound,
    ) -> dict[int, Result]:
        self.control.begin(request)
        try:
            for rank, link in sorted(links.items()):
                if not link.send(message):
                    request.fail_rank(rank, "control connection closed")
            try:
                return wait_within(
                    request,
                    links,
                    silence_s=self.args.request_silence_limit_s,
                    bound=bound,
                    steps=message.request.steps,
                )
            except RequestFailed as exc:
                raise self.request_failed(request, links, exc) from None
        finally:
            self.control.end(request)

    def request_failed(
        self, request: RequestInFlight, links: dict[int, RankLink], exc: RequestFailed
    ) -> RequestFailed:
        """A request that failed: its answer, named as the run's verdict names its culprit.
        A rank that fails a request has failed (it journals so and leaves), and one that went
        silent is stuck in it: neither can serve the next request, so the ranks are replaced
        (a restart), or the server fails for good when none is left."""
        # A silent rank is told, so that it journals why the server gave it up (its reader
        # thread answers; its main thread is stuck).
        for rank, silent_s in exc.silent.items():
            links[rank].send(GivenUp(request_id=request.request_id, silent_s=silent_s))
        why = f"request {request.request_id} failed: {exc}"
        restart = self.restarts.begin(why)
        self.fail(why)
        named = self.run_failure.named(exc)
        named.run_id = self.group.run_id
        if restart:
            threading.Thread(target=self._restart, name="ranks-restart", daemon=True).start()
        return named

    def withdraw(self, request_id: str, reason: str) -> None:
        """Cancel a request from outside (its client gone, its job deleted): the one running
        stops between steps on every rank; one waiting in line is never run."""
        self.line.withdraw(request_id, reason)
