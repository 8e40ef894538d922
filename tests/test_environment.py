"""The installed environment imports every library the toolkit relies on.

A CPU-only `torch+cpu` wheel breaks `import torchvision` ("operator torchvision::nms
does not exist"), and timm, open_clip and clean-fid import torchvision: this test
catches an install that picked the wrong torch build.
"""

import importlib

import pytest

LIBRARIES = [
    "torch",
    "triton",
    "torchvision",
    "accelerate",
    "diffusers",
    "open_clip",
    "cleanfid",
    "timm",
    "einops",
    "scipy",
    "safetensors",
    "tensorboard",
    "tqdm",
    "PIL",
    "matplotlib",
    "uvic",
    "uvic_kernels",
]


@pytest.mark.parametrize("name", LIBRARIES)
def test_library_imports(name: str) -> None:
    importlib.import_module(name)


def test_torchvision_operators_work() -> None:
    """torchvision's compiled operators are registered (fails with a mismatched torch)."""
    import torch
    import torchvision

    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.9]])
    keep = torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8]), iou_threshold=0.5)
    assert keep.tolist() == [0]


def test_kernels_import_name_does_not_shadow_hub_kernels() -> None:
    """Our kernels folder is importable as `uvic_kernels`, never as a bare `kernels`."""
    import uvic_kernels

    assert uvic_kernels.__name__ == "uvic_kernels"
    assert hasattr(uvic_kernels, "attention")
