"""Another pipeline class served through its own call: its reply's stages are its own
components, each timed whether the pipeline calls the module or its `decode`."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.pipelinedirs import save_small_ltx
from tests.support import serve

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

QUICK = ("--warmup-mode", "none", "--smoke-request", "off", "--default-shape", "32x32x9")
REQUEST = {"prompt": "a cat walks", "width": 32, "height": 32, "frames": 9, "steps": 2}


# Slow tier: another class run through its own call boots, measured by its components, in
# tests/adapters/test_diffusers_cli.py's default run.
@pytest.mark.slow
def test_an_ltx_reply_says_its_vae_ran(tmp_path: Path) -> None:
    """LTX-Video decodes through `vae.decode`, not the VAE module: the reply to /generate
    lists the VAE, text encoder and transformer, each as ran with a time above zero."""
    model = save_small_ltx(tmp_path / "small-ltx")
    with serve(tmp_path, "--model-path", str(model), *QUICK) as server:
        server.wait_for_health(200, within=240)
        reply = server.client.post("/generate", json=REQUEST, timeout=240)
        assert reply.status_code == 200, reply.text
        assert server.stop() == 0
    stages = {stage["name"]: stage for stage in reply.json()["stages"]}
    assert set(stages) == {"vae", "text_encoder", "transformer"}
    assert all(stage["ran"] and stage["seconds"] > 0 for stage in stages.values()), stages
