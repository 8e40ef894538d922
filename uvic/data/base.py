"""What every dataset module shares: the error for unusable data and the pixel range.

`uvic.data.datasets` (CIFAR-10, Shapes, MS-COCO), `uvic.data.imagenet` and
`uvic.data.celeba` all raise `DatasetError` and yield pixels through `to_signed`; they live
here so that the dataset modules need not import each other.
"""

from __future__ import annotations

import numpy as np
import torch


class DatasetError(FileNotFoundError):
    """Data files are missing or unusable; the message names the path and the fix."""


def to_signed(images_uint8: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 (..., H, W, C) -> float32 (..., C, H, W) in [-1, 1]."""
    x = torch.tensor(np.asarray(images_uint8), dtype=torch.float32)  # a copy
    return (x / 127.5 - 1.0).movedim(-1, -3).contiguous()
