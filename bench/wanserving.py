"""/generate on tiny-wan through a real `lifecycle serve --model-path DIR` against the same call
of `WanPipeline` in a warm process, and the step time of CFG-parallel 2 and Ulysses 2 against
one rank's, the requests of every side interleaved."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import Pool
from bench.serving import ServeProcess
from bench.stats import median
from bench.suite import Settings, progress
from bench.table import Row, format_ratio, format_seconds, ratio_at_most

GENERATE_TARGET = 1.05
READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0


class WanServer(ServeProcess):
    """`lifecycle serve --model-path DIRECTORY ARGS...` on a free loopback port."""

    def __init__(
        self,
        *,
        workdir: Path,
        label: str,
        directory: Path,
        args: Sequence[str],
        env: Mapping[str, str],
    ) -> None:
        super().__init__(
            label=label,
            options=("--model-path", str(directory), *args),
            db=workdir / f"diffusers-serve-{label}.db",
            cwd=workdir,
            env=env,
            ready_within=READY_TIMEOUT_S,
            request_timeout_s=REQUEST_TIMEOUT_S,
        )

    def generate(self, body: Mapping[str, Any]) -> tuple[float, dict[str, Any]]:
        """POST /generate with a JSON reply: the seconds the client waited, and the reply."""
        seconds, content = self.post_generate(body)
        reply: dict[str, Any] = json.loads(content)
        return seconds, reply


# A client's request, as /generate takes it and WanPipeline.__call__ takes the same fields.
PROMPT = "a cat walks on the street at night, slow motion"
NEGATIVE_PROMPT = "blurry, static"
GUIDANCE_SCALE = 5.0
SEED = 7
ONE, PLAIN = "1 rank", "WanPipeline"
# The layouts served beside one rank, for their step time.
PARALLEL = {
    "cfg-parallel 2": ("--num-ranks", "2", "--cfg-parallel", "2"),
    "ulysses 2": ("--num-ranks", "2", "--ulysses", "2"),
}
QUICK_LAYOUT = "ulysses 2"


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    seconds: float
    step_s: tuple[float, ...]
    checksum: str


def generate_body(request: tuple[int, int, int, int]) -> dict[str, Any]:
    """/generate's body, whose fields the library's call takes too."""
    width, height, frames, steps = request
    return {
        "prompt": PROMPT,
        "negative_prompt": NEGATIVE_PROMPT,
        "width": width,
        "height": height,
        "frames": frames,
        "steps": steps,
        "guidance_scale": GUIDANCE_SCALE,
        "seed": SEED,
    }


def _served(server: WanServer, body: Mapping[str, Any]) -> Callable[[], Reply]:
    def run() -> Reply:
        seconds, reply = server.generate(body)
        return Reply(seconds=seconds, step_s=tuple(reply["step_s"]), checksum=reply["checksum"])

    return run


def _plain(pool: Pool, directory: Path, body: Mapping[str, Any]) -> Callable[[], Reply]:
    payload = {"directory": str(directory), "request": dict(body)}

    def run() -> Reply:
        (doc,) = pool.round([payload])
        return Reply(seconds=doc["seconds"], step_s=(), checksum=doc["checksum"])

    return run


def _interleaved(sides: Mapping[str, Callable[[], Reply]], rounds: int) -> dict[str, list[Reply]]:
    """Every side once per round, the order rotated each round; one untimed warm-up first."""
    for run in sides.values():
        run()
    names = list(sides)
    results: dict[str, list[Reply]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            results[name].append(sides[name]())
    return results


def serving_rows(
    settings: Settings,
    directory: Path,
    *,
    model_args: Sequence[str],
    env: Mapping[str, str],
    request: tuple[int, int, int, int],
    rounds: int,
) -> list[Row]:
    """Two phases, so that no idle server shares the cores with a comparison it is not in:
    one rank against WanPipeline, then the parallel layouts against one rank."""
    body = generate_body(request)
    progress(f"diffusers: serving tiny-wan on {ONE} against {PLAIN}; {rounds} rounds")
    with _servers(settings, directory, {ONE: ()}, model_args, env) as servers:
        pool = Pool("bench.wanplain", size=1, workdir=settings.workdir, timeout_s=READY_TIMEOUT_S)
        try:
            sides = {ONE: _served(servers[ONE], body), PLAIN: _plain(pool, directory, body)}
            plain = _interleaved(sides, rounds)
        finally:
            pool.close()
    # A quick run serves one parallel layout: each is a server of two ranks beside the others.
    layouts = {k: v for k, v in PARALLEL.items() if not settings.quick or k == QUICK_LAYOUT}
    progress(f"diffusers: serving tiny-wan on {', '.join(layouts)} against {ONE}")
    with _servers(settings, directory, {ONE: (), **layouts}, model_args, env) as servers:
        parallel = _interleaved({k: _served(v, body) for k, v in servers.items()}, rounds)
    return [
        _generate_row(plain, body, model_args, rounds),
        *_step_rows(parallel, body, rounds, layouts),
    ]


@contextlib.contextmanager
def _servers(
    settings: Settings,
    directory: Path,
    layouts: Mapping[str, Sequence[str]],
    model_args: Sequence[str],
    env: Mapping[str, str],
) -> Iterator[dict[str, WanServer]]:
    """A server per layout, all started before any is waited for; every one stopped after."""
    servers: dict[str, WanServer] = {}
    try:
        for label, layout in layouts.items():
            servers[label] = WanServer(
                workdir=settings.workdir, label=label.replace(" ", "-"), directory=directory,
                args=(*model_args, *layout), env=env,
            )  # fmt: skip
        for server in servers.values():
            server.wait_ready()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def _shape(body: Mapping[str, Any]) -> str:
    return f"{body['width']}x{body['height']}x{body['frames']} at {body['steps']} steps"


def _generate_row(
    results: Mapping[str, list[Reply]], body: Mapping[str, Any], model_args: Sequence[str],
    rounds: int,
) -> Row:  # fmt: skip
    served = [r.seconds for r in results[ONE]]
    plain = [r.seconds for r in results[PLAIN]]
    ratios = [a / b for a, b in zip(served, plain, strict=True)]
    ratio = median(ratios)
    same = {r.checksum for r in results[ONE]} == {r.checksum for r in results[PLAIN]}
    return Row(
        figure="diffusers: tiny-wan /generate, lifecycle serve 1 rank",
        value=format_seconds(median(served)),
        baseline=format_seconds(median(plain)) + " WanPipeline",
        **ratio_at_most(ratio, GENERATE_TARGET, spec=".2f"),
        how=(
            f"POST /generate {_shape(body)} (prompt, negative prompt, guidance"
            f" {body['guidance_scale']:g}, seed {body['seed']}), JSON reply, the seconds the"
            f" client waited, to `lifecycle serve --model-path DIR {' '.join(model_args)}`"
            " with LIFECYCLE_DISABLE_AUTO_RESIDENCY=1 (the reference residency: the VAE"
            " whole, the text encoder resident, as WanPipeline runs them); against"
            " WanPipeline.__call__ with the same fields in a warm process"
            " (from_pretrained of the same directory), timed around the call; one warm-up"
            f" request each, then {rounds} rounds, the order rotated each round, no other"
            " server running; medians, the ratio is the median of the paired"
            f" ratios (ratio of the medians: {format_ratio(median(served) / median(plain))});"
            f" outputs {'identical' if same else 'DIFFER'} (checksums)"
        ),
    )


def _step_rows(
    results: Mapping[str, list[Reply]],
    body: Mapping[str, Any],
    rounds: int,
    layouts: Mapping[str, Sequence[str]],
) -> list[Row]:
    one = median([s for r in results[ONE] for s in r.step_s])
    rows = []
    for label, layout in layouts.items():
        step = median([s for r in results[label] for s in r.step_s])
        same = {r.checksum for r in results[label]} == {r.checksum for r in results[ONE]}
        output = "the same as" if same else "not bit for bit"
        rows.append(
            Row(
                figure=f"diffusers: tiny-wan step time, {label} / 1 rank",
                value=format_seconds(step),
                baseline=format_seconds(one) + " 1 rank",
                ratio=format_ratio(step / one),
                target="no target",
                how=(
                    f"rank 0's step_s in /generate's JSON, every step of {rounds} requests"
                    f" {_shape(body)} (after one warm-up request), interleaved with the 1-rank"
                    f" server's; `lifecycle serve {' '.join(layout)}`: 2 rank processes on"
                    " gloo, each with half the cores' threads (the lifecycle's setting), the"
                    f" 1 rank with all of them; output {output}"
                    " 1 rank's (checksums)"
                ),
            )
        )
    return rows
