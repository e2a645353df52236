"""A rank serving after ready: the server's orders through its control line (the launcher's
connection, or under torchrun its bridge), each request run on every rank and answered, until
a stop or the rank's failure."""

from __future__ import annotations

import functools
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from lifecycle.core.decisions.requesttime import RequestCancelled
from lifecycle.core.errors import (
    CollectiveError,
    PeerGone,
    RequestAborted,
    RequestStalled,
    classify,
)
from lifecycle.core.format.records import shared_fields
from lifecycle.core.settings.validation import validate_shape
from lifecycle.serve.ranks.cancel import StepCancels
from lifecycle.serve.ranks.control import ControlInbox, Line
from lifecycle.serve.ranks.crossnode import RankBridge
from lifecycle.serve.ranks.messages import (
    CancelPoint,
    Generate,
    GivenUp,
    Lost,
    Progress,
    Ready,
    Rest,
    Result,
    Stop,
)

if TYPE_CHECKING:
    from lifecycle.runtime.rankruntime import RankRuntime
    from lifecycle.runtime.session import RankSession


def fail_on_lost(session: RankSession, lost: Lost) -> None:
    """Rank 0 is gone (the rank fails on it), or this rank was silent long enough for the
    group to go on without it: it fails on that once, as when the group's announcement of its
    loss reaches its abort watcher, whichever comes first."""
    from lifecycle.runtime.group.abort import rank_lost

    if lost.rank != session.launch.rank:
        session.fail(
            PeerGone(lost.why, group="control", group_seq=0, op="broadcast"), where=lost.why
        )
        return
    state = session.machine.state.value
    session.abort(rank_lost(lost.rank, lost.why, state=state, announced_by="rank"))


def _given_up(runtime: RankRuntime, given: GivenUp) -> Exception:
    """Why this rank failed once the server gave its request up: stuck in its own work
    (RequestStalled), or waiting in a collective for a peer that is (a wait, as the verdict
    reads it: the peer is the culprit)."""
    pending = runtime.comm.pending.snapshot()
    if pending is None:
        return RequestStalled(request_id=given.request_id, silent_s=given.silent_s)
    return CollectiveError(
        f"request {given.request_id} given up by the server while this rank waited"
        f" {pending.waiting_s:.0f} s in {pending.group} #{pending.group_seq} {pending.op}"
        f" ({pending.purpose}) for a peer",
        group=pending.group,
        group_seq=pending.group_seq,
        op=pending.op,
    )


# A peer that gave up a request for a stop hangs up on the collective this rank waits in;
# the same stop reaches this rank at about the same time, and is waited for this long before
# the hang-up is taken for a failure.
PEER_STOP_GRACE_S = 2.0


def serve_requests(session: RankSession, control: Connection | Line) -> None:
    """Answer the launcher's requests until it says stop or the rank fails."""
    runtime = session.runtime
    assert runtime is not None
    rank = session.launch.rank

    def answer(message: CancelPoint) -> None:
        inbox.send(message)  # the inbox made below: its reader thread answers a cancel

    cancels = StepCancels(rank=rank, send=answer)
    inbox = ControlInbox(
        control,
        on_dump=session.dump_ring,
        on_given_up=lambda given: session.fail(
            _given_up(runtime, given), where=f"the server gave request {given.request_id} up"
        ),
        on_lost=lambda lost: fail_on_lost(session, lost),
        on_cancel=cancels.on_message,
    )
    session.serve_collectives_from_ring()
    if isinstance(control, RankBridge):
        control.join_control_group()  # every rank at once, as it enters its serve loop
    inbox.send(Ready(rank=rank))
    served = 0
    while True:
        message = inbox.next()
        if isinstance(message, Stop):
            session.stop(reason=message.reason, signal_name=message.signal)
            return
        if isinstance(message, Lost):
            return  # failed (or aborted) by the reader thread
        if inbox.stopping:
            continue
        if isinstance(message, Rest):
            if not _rest(session, runtime, message, inbox=inbox):
                return
            continue
        served += 1
        if not _serve_request(session, runtime, message, nth=served, inbox=inbox, cancels=cancels):
            return


def _serve_request(
    session: RankSession,
    runtime: RankRuntime,
    message: Generate,
    *,
    nth: int,
    inbox: ControlInbox,
    cancels: StepCancels,
) -> bool:
    """Run the rank's `nth` request and answer it; False once the rank serves no more (it
    stopped or failed)."""
    from lifecycle.runtime.request import generate

    request_id = message.request_id
    reply = functools.partial(Result, request_id=request_id, rank=session.launch.rank)
    cancels.begin(request_id)
    after_step = _after_step(
        session, inbox, cancels, request_id=request_id, nth=nth, steps=message.request.steps
    )
    try:
        request = message.request
        validate_shape(session.args.model, request.shape, request.steps)
        generated = generate(
            runtime,
            request,
            source="http",
            request_id=request_id,
            keep_video=message.return_video,
            after_step=after_step,
            traceparent=message.traceparent,
        )
        video = None if generated.video is None else generated.video.numpy()
        cancels.end(request_id)
        inbox.send(reply(ok=True, video=video, **shared_fields(generated.result, Result)))
    except RequestCancelled as exc:  # journaled by generate; the rank serves on
        cancels.end(request_id)
        inbox.send(
            reply(ok=False, error=str(exc), error_kind=classify(exc), cancelled_after=exc.step)
        )
    except Exception as exc:  # the request failed on this rank: journal it, fail, report
        cancels.end(request_id)
        _request_failed(session, inbox, exc, request_id=request_id)
        return False
    return True


def _rest(
    session: RankSession, runtime: RankRuntime, message: Rest, *, inbox: ControlInbox
) -> bool:
    """Sleep (ready, asleep: the weights let go) or wake (asleep, waking, ready: the weights
    back and verified), each a journaled transition with its actions, and answer; False once
    the rank serves no more (it failed)."""
    from lifecycle.core.format.states import Trigger
    from lifecycle.runtime.actions import wake_weights
    from lifecycle.runtime.keeping.sleeping import release_weights

    try:
        if message.wake:
            session.fire(Trigger.WAKE)
            session.act("wake-weights", lambda: wake_weights(runtime))
            session.fire(Trigger.FINISH)
        else:
            session.fire(Trigger.SLEEP)
            session.act("release-weights", lambda: release_weights(runtime))
    except Exception as exc:  # the rank cannot sleep or wake: journal it, fail, report
        _request_failed(session, inbox, exc, request_id=message.request_id)
        return False
    inbox.send(Result(request_id=message.request_id, rank=session.launch.rank, ok=True))
    return True


def _after_step(
    session: RankSession,
    inbox: ControlInbox,
    cancels: StepCancels,
    *,
    request_id: str,
    nth: int,
    steps: int,
) -> Callable[[int], None]:
    """What the rank does after each denoising step of its `nth` request: gives it up for a
    stop, injects its fault halfway, reports the step and answers a cancel."""
    rank = session.launch.rank

    def stopping() -> str | None:
        return inbox.stop_message.reason if inbox.stopping else None

    def after_step(step: int) -> None:
        if inbox.stopping:
            raise RequestAborted(request_id=request_id, step=step, reason=inbox.stop_message.reason)
        if step + 1 == max(1, steps // 2):
            session.faults.inject_in_request(nth)
        inbox.send(Progress(request_id=request_id, rank=rank, step=step))
        cancels.after_step(request_id, step, steps=steps, stopping=stopping)

    return after_step


def _request_failed(
    session: RankSession, inbox: ControlInbox, exc: Exception, *, request_id: str
) -> None:
    """A request that failed on this rank: a stop where it was given up for one, here or on
    a peer, else the rank's failure, journaled and reported."""
    from lifecycle.core.errors import CollectiveError, CollectiveTimeout

    hung_up = isinstance(exc, CollectiveError) and not isinstance(exc, CollectiveTimeout)
    stopped = (
        isinstance(exc, RequestAborted)
        or inbox.stopping
        or (hung_up and inbox.wait_for_stop(PEER_STOP_GRACE_S))
    )
    if stopped:
        # Given up for a stop, here or on a peer: a shutdown, not a failure.
        stop = inbox.stop_message
        session.stop(reason=stop.reason, signal_name=stop.signal)
        return
    session.fail(exc)
    error = f"{type(exc).__name__}: {exc}"
    inbox.send(
        Result(
            request_id=request_id,
            rank=session.launch.rank,
            ok=False,
            error=error,
            error_kind=classify(exc),
        )
    )
