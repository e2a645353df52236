"""The lifecycle's Offloader on CPU: a module's weights written to a file and freed, and brought
back with every buffer, persistent or not, on the module's device."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from lifecycle.pipelines import Offloader

CPU = torch.device("cpu")


class Rotated(nn.Module):
    """A projection whose input is turned by a rotary table, as attention blocks do: the table
    is a buffer the state dict leaves out (persistent=False), shared by two layers, beside a
    persistent buffer and the weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)
        table = torch.linspace(0.1, 3.0, 16)
        self.proj.register_buffer("inv_freq", table, persistent=False)
        self.out.register_buffer("inv_freq", table, persistent=False)
        self.register_buffer("scale", torch.full((16,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        turned = self.proj(x * torch.cos(self.proj.inv_freq))
        return self.out(turned * torch.sin(self.out.inv_freq)) * self.scale


def every_tensor(module: nn.Module) -> dict[str, torch.Tensor]:
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return named


def offload_files(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("lifecycle-offload-*"))


@pytest.fixture
def offload_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Offload files go to this test's own directory, so that the test can see them."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    return tmp_path


def test_a_module_with_a_non_persistent_buffer_computes_the_same_after_a_round_trip(
    offload_dir: Path,
) -> None:
    """A module offloaded and restored on CPU gives the same output as before, every parameter
    and buffer (the rotary table the state dict leaves out included, still shared by its two
    layers) back on the module's device, and no file left behind."""
    module = Rotated().eval()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = module(x)
    offloader = Offloader(module, CPU)
    offloader.offload()
    assert len(offload_files(offload_dir)) == 1
    offloader.restore()
    assert offload_files(offload_dir) == []
    devices = {name: t.device for name, t in every_tensor(module).items()}
    assert devices == dict.fromkeys(devices, CPU), devices
    assert module.proj.inv_freq.data_ptr() == module.out.inv_freq.data_ptr()
    with torch.no_grad():
        assert torch.equal(module(x), before)


def test_an_offloaded_module_holds_no_weights_or_buffers_until_restored(
    offload_dir: Path,
) -> None:
    """While offloaded, every parameter and every buffer of the module is released (on the
    meta device), the non-persistent ones too; a second round trip gives the same output."""
    module = Rotated().eval()
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = module(x)
    offloader = Offloader(module, CPU)
    for _ in range(2):
        offloader.offload()
        assert all(t.is_meta for t in every_tensor(module).values())
        offloader.restore()
        with torch.no_grad():
            assert torch.equal(module(x), before)
    offloader.close()


def test_a_text_encoder_with_a_rotary_table_encodes_the_same_after_a_round_trip(
    offload_dir: Path,
) -> None:
    """tiny-qwen-image's Qwen2.5-VL text encoder, whose rotary inverse frequencies are not in
    its state dict, encodes a prompt to the same hidden states after an offload and restore."""
    pytest.importorskip("diffusers")
    from lifecycle.adapters.diffusers.qwen.tinyqwen import build_tiny_qwen_image

    pipe = build_tiny_qwen_image()
    ids = pipe.tokenizer("a cat walks in the rain", return_tensors="pt").input_ids
    encoder = pipe.text_encoder
    with torch.no_grad():
        before = encoder(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    offloader = Offloader(encoder, CPU)
    offloader.offload()
    offloader.restore()
    assert not any(t.is_meta for t in every_tensor(encoder).values())
    with torch.no_grad():
        after = encoder(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    assert torch.equal(after, before)
