"""Upcasters: each turns a stored payload of one event version into the next version's payload.

An upcaster reads journals written before a field existed, so it is the one place where what
older lifecycles wrote (class names, message text) may be matched to derive that field.
"""

from __future__ import annotations

from typing import Any

from lifecycle.core.errors import ErrorKind

# The class names version 1 error payloads were written with, as they were then: a class
# renamed since does not change how an old journal reads.
_V1_ERROR_TYPES: dict[str, ErrorKind] = {
    "CollectiveTimeout": ErrorKind.COLLECTIVE_TIMEOUT,
    "CollectiveError": ErrorKind.COLLECTIVE_FAILED,
    "InjectedFault": ErrorKind.INJECTED_FAULT,
    "IllegalTransition": ErrorKind.ILLEGAL_TRANSITION,
    "StartupTimeout": ErrorKind.STARTUP_TIMEOUT,
    "JournalWriteFailed": ErrorKind.JOURNAL_WRITE,
    "RankDisagreement": ErrorKind.RANK_DISAGREEMENT,
    "RendezvousFailed": ErrorKind.RENDEZVOUS,
    "RequestAborted": ErrorKind.REQUEST_ABORTED,
    "ConfigError": ErrorKind.CONFIG,
    "FaultSpecError": ErrorKind.CONFIG,
    "PlanError": ErrorKind.CONFIG,
    "JournalError": ErrorKind.JOURNAL,
    "JournalConflict": ErrorKind.JOURNAL,
}
# What gloo and the kernel say when a peer's end of a connection goes away: version 1 recorded
# such a broken collective as a plain CollectiveError with torch's message in its text.
_V1_PEER_GONE = ("closed by peer", "reset by peer", "connection closed", "connection reset")


def upcast_error_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """Version 2 of `error` adds `error_kind`, derived here from the v1 class name and message."""
    error_type = payload.get("error_type")
    message = payload.get("message")
    # A payload too broken to read is left to the decoder to refuse.
    kind = ErrorKind.EXCEPTION
    if isinstance(error_type, str):
        kind = _V1_ERROR_TYPES.get(error_type, ErrorKind.EXCEPTION)
    if (
        kind is ErrorKind.COLLECTIVE_FAILED
        and isinstance(message, str)
        and any(marker in message.lower() for marker in _V1_PEER_GONE)
    ):
        kind = ErrorKind.PEER_GONE
    return {**payload, "error_kind": kind.value}


# Version 1 wrote a shape as three flat fields, `{prefix}width`, `{prefix}height` and
# `{prefix}frames`; version 2 nests it as a Shape object. What is missing stays missing, and
# what is not an object is left as it is, for the decoder to refuse with its name.
_AXES = ("width", "height", "frames")


def _nested_shape(payload: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {axis: payload[prefix + axis] for axis in _AXES if prefix + axis in payload}


def _without_flat_shape(payload: dict[str, Any], *prefixes: str) -> dict[str, Any]:
    flat = {prefix + axis for prefix in prefixes for axis in _AXES}
    return {k: v for k, v in payload.items() if k not in flat}


def _shape_nested(record: dict[str, Any]) -> dict[str, Any]:
    return {**_without_flat_shape(record, ""), "shape": _nested_shape(record, "")}


def upcast_warmup_record_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """Version 2 of `warmup_record` nests width, height and frames as `shape`."""
    return _shape_nested(payload)


def upcast_request_started_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """Version 2 of `request_started` nests width, height and frames as `shape`."""
    return _shape_nested(payload)


def _probe_fit_nested(fit: dict[str, Any]) -> dict[str, Any]:
    out = {
        **_without_flat_shape(fit, "default_", "fitted_"),
        "default": _nested_shape(fit, "default_"),
    }
    fitted = _nested_shape(fit, "fitted_")
    # v1 wrote all three fitted fields as null when no candidate fitted.
    if len(fitted) == len(_AXES) and all(value is None for value in fitted.values()):
        out["fitted"] = None
    elif fitted:
        out["fitted"] = fitted
    return out


def upcast_plan_built_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """Version 2 of `plan_built` nests each request's shape, and the probe fit's default and
    fitted shapes, as Shape objects."""
    out = dict(payload)
    requests = payload.get("requests")
    if isinstance(requests, list):
        out["requests"] = [_shape_nested(r) if isinstance(r, dict) else r for r in requests]
    fit = payload.get("probe_fit")
    if isinstance(fit, dict):
        out["probe_fit"] = _probe_fit_nested(fit)
    return out


def upcast_heartbeat_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """Version 2 of `heartbeat` adds each group's progress; version 1 wrote every collective,
    so its heartbeats carry none."""
    return {**payload, "groups": []}


def upcast_request_finished_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """Version 2 of `request_finished` adds its collectives; version 1 journaled each of them
    instead, so none is counted here."""
    return {**payload, "collectives": 0, "groups": []}


def upcast_request_started_v2_to_v3(payload: dict[str, Any]) -> dict[str, Any]:
    """Version 3 of `request_started` adds the negative prompt's length, the guidance scale and
    the seed; a version 2 request had no negative prompt, and its guidance and seed were not
    journaled."""
    return {**payload, "negative_prompt_chars": 0, "guidance_scale": None, "seed": None}


def upcast_residency_verified_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """Version 2 of `residency_verified` adds the re-warm's measured and predicted times;
    version 1 verified memory only."""
    return {**payload, "measured_s": None, "predicted_s": None}


def upcast_run_started_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """Version 2 of `run_started` adds the launch phase; version 1 did not measure it."""
    return {
        **payload,
        "launcher_started_wall": None,
        "process_started_wall": None,
        "imports_s": None,
    }


def upcast_run_started_v2_to_v3(payload: dict[str, Any]) -> dict[str, Any]:
    """Version 3 of `run_started` splits the launch into phases; version 2 measured only the
    imports, whole (its `imports_s`)."""
    return {**payload, "phases": []}


def upcast_residency_planned_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """Version 2 of `residency_planned` journals why no plan was reused as a code and its
    facts; version 1's sentence is kept whole, under the code `text`."""
    reuse = payload.get("reuse")
    if not isinstance(reuse, str):
        return payload  # for the decoder to refuse
    return {**payload, "reuse": {"code": "text", "note": reuse}}
