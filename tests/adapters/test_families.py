"""The table of model families: a pipeline class added as one entry (its spec reader and its
adapter) is read, built and booted as that family, component by component."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.pipelinedirs import save_small_ddpm
from lifecycle.adapters.diffusers import register, spec_for_directory
from lifecycle.adapters.diffusers.directory import PipelineDirectory
from lifecycle.adapters.diffusers.families import FAMILIES, Family, driven_classes
from lifecycle.core.format.events import GateDecided, WarmupRecord
from lifecycle.core.format.states import State
from lifecycle.core.settings.config import ServerArgs
from lifecycle.core.settings.modelspec import MODEL_PRESETS
from lifecycle.pipelines import DIFFUSERS_COMPONENTS_BACKEND, Comm, ModelSpec, Shape
from lifecycle.runtime import pipeline as runtime_pipeline
from lifecycle.runtime.pipeline import build_pipeline
from lifecycle.runtime.recorder import Recorder
from lifecycle.runtime.session import RankLaunch, RankSession
from lifecycle.store.journal import Journal
from lifecycle.store.runs import new_run_id, run_row

STEPS = 3
SEED = 5


def ddpm_spec(directory: PipelineDirectory, _pipeline_class: Any) -> ModelSpec:
    """An unconditional DDPM directory as an image model of its UNet's sample size."""
    unet = directory.config("unet")
    side = int(unet["sample_size"])
    return ModelSpec(
        name=directory.name, task="text-to-image", default_width=side, default_height=side,
        default_frames=1, default_steps=STEPS, frame_multiple=1, spatial_multiple=side,
        pixels_per_token_side=side, frames_per_latent=1, attention_heads=1,
        backend=DIFFUSERS_COMPONENTS_BACKEND, source=str(directory.path),
        source_digest=directory.digest,
    )  # fmt: skip


class DDPMAdapter:
    """DDPMPipeline's loop, driven on its own UNet and scheduler."""

    components = ("prompt", "unet", "image")

    def __init__(self, spec: ModelSpec, comm: Comm, pipe: Any) -> None:
        self.spec, self.comm, self.pipe = spec, comm, pipe

    @property
    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pipe.unet.parameters())

    def encode_prompt(self, prompt: str, negative_prompt: str) -> None:
        return None  # unconditional

    @torch.no_grad()
    def denoise(
        self, embeds: None, shape: Shape, steps: int, *, seed: int, guidance_scale: float,
        on_step: Callable[[int], None],
    ) -> torch.Tensor:  # fmt: skip
        unet, scheduler = self.pipe.unet, self.pipe.scheduler
        generator = torch.Generator("cpu").manual_seed(seed)
        side = unet.config.sample_size
        image = torch.randn((1, unet.config.in_channels, side, side), generator=generator)
        scheduler.set_timesteps(steps)
        for step, t in enumerate(scheduler.timesteps):
            output = unet(image, t).sample
            image = scheduler.step(output, t, image, generator=generator).prev_sample
            on_step(step)
        return image  # type: ignore[no-any-return]

    def decode(self, latents: torch.Tensor, shape: Shape) -> torch.Tensor:
        image = (latents / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1)
        return (image * 255.0).round().clamp(0, 255).to(torch.uint8)


@pytest.fixture
def ddpm_family(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """DDPMPipeline's entry in the table, and the models registered meanwhile forgotten after."""
    monkeypatch.setitem(FAMILIES, "DDPMPipeline", Family(read_spec=ddpm_spec, adapter=DDPMAdapter))
    presets = dict(MODEL_PRESETS)
    monkeypatch.setattr(runtime_pipeline, "_FACTORIES", dict(runtime_pipeline._FACTORIES))
    yield
    MODEL_PRESETS.clear()
    MODEL_PRESETS.update(presets)


@pytest.fixture(scope="module")
def ddpm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_small_ddpm(tmp_path_factory.mktemp("ddpm") / "tiny-ddpm")


@pytest.mark.usefixtures("ddpm_family")
def test_a_family_added_as_one_entry_drives_its_directory(ddpm_dir: Path) -> None:
    """With one entry for DDPMPipeline, its directory's spec is the family's (several ranks,
    its components driven), DDPMPipeline is listed among the classes driven, and the pipeline
    the lifecycle builds makes DDPMPipeline's own image for the same seed."""
    from diffusers import DDPMPipeline

    spec = spec_for_directory(str(ddpm_dir))
    assert (spec.backend, spec.task, spec.default_shape) == (
        DIFFUSERS_COMPONENTS_BACKEND, "text-to-image", Shape(width=16, height=16, frames=1),
    )  # fmt: skip
    assert "DDPMPipeline" in driven_classes()
    register(spec)
    pipeline = build_pipeline(spec, Comm.alone(torch.device("cpu")))
    assert isinstance(pipeline, DDPMAdapter)
    latents = pipeline.denoise(
        None, spec.default_shape, STEPS, seed=SEED, guidance_scale=1.0, on_step=lambda _: None
    )
    ours = pipeline.decode(latents, spec.default_shape).numpy()
    reference = DDPMPipeline.from_pretrained(str(ddpm_dir), local_files_only=True)
    reference.set_progress_bar_config(disable=True)
    theirs = reference(
        generator=torch.Generator("cpu").manual_seed(SEED), num_inference_steps=STEPS,
        output_type="np",
    ).images  # fmt: skip
    expected = np.clip(np.round(theirs * 255.0), 0, 255).astype(np.uint8)
    assert ours.shape == expected.shape == (1, 16, 16, 3)
    assert int(np.abs(ours.astype(int) - expected.astype(int)).max()) <= 1


@pytest.mark.usefixtures("ddpm_family")
def test_a_family_boots_with_the_diffusers_backend_gate_open(
    ddpm_dir: Path, tmp_path: Path
) -> None:
    """A startup of the added family's directory reaches ready; its gate-check passes the
    diffusers-backend gate (it drives the components), and its warmup records the family's
    own stages."""
    spec = dataclasses.replace(spec_for_directory(str(ddpm_dir)), name="ddpm-family")
    register(spec)
    db = str(tmp_path / "j.db")
    args = ServerArgs(model=spec, db=db)
    journal = Journal.open_for_write(db)
    run_id = new_run_id(time.time())
    journal.create_run(run_row(args, run_id=run_id, created_at=time.time()))
    launch = RankLaunch(run_id=run_id, rank=0, local_ranks=1, distributed=False)
    session = RankSession(args, launch, Recorder(journal.writer(run_id=run_id, rank=0)))
    try:
        assert session.boot() is State.READY
    finally:
        session.close()
        journal.close()
    reader = Journal.open_for_read(db)
    events = [e.event for e in reader.read(run_id=run_id)]
    reader.close()
    (gates,) = [e for e in events if isinstance(e, GateDecided)]
    outcome = {g.name: g.passed for g in gates.gates}
    assert outcome["diffusers-backend"] is True
    records = [e for e in events if isinstance(e, WarmupRecord)]
    assert records and {s.name for s in records[0].stages} == {"prompt", "unet", "image"}
