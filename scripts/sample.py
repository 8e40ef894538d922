"""Sample images from U-ViT / U-ViC checkpoints into an image grid (and optional PNGs).

    python scripts/sample.py --config configs/cifar10_uvic.py \
        --ckpt runs/cifar10_uvic/ema.safetensors --n 64 --out samples/cifar10_uvic
    # U-ViT and U-ViC side by side, same noise:
    python scripts/sample.py --config configs/cifar10_uvit.py \
        --ckpt runs/cifar10_uvit/ema.safetensors --label U-ViT \
        --ckpt runs/cifar10_uvic/ema.safetensors --label U-ViC --out samples/compare
    # text-to-image, prompts one per line (default: the feature folder's sample prompts):
    python scripts/sample.py --config configs/mscoco_uvic.py --ckpt nnet_ema.pth \
        --prompts prompts.txt --cfg-scale 1.0 --out samples/coco
    # many images on all GPUs:
    accelerate launch scripts/sample.py ... --n 1000 --save-individual

The config may also be a run's saved config.json. Checkpoints are our EMA .safetensors or a
released U-ViT nnet_ema.pth. The same --seed gives the same images on any device, batch
size or number of processes. This file runs `uvic.cli.sample` (installed as `uvic-sample`).
"""

import sys

from uvic.cli.sample import main

if __name__ == "__main__":
    sys.exit(main())
