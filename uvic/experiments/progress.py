"""How long a long experiment takes (`uvic-compare` and the table programs): its cells (a
trained run, an evaluation) with their cost in model FLOPs, progress with an ETA from the
cells measured so far, and the dry run's time calibrated on one measured cell.

A cell's cost is what its network does (`uvic.models.flops`): a training run's images x
its model's training FLOPs, an evaluation's network calls x its forward FLOPs. The time
of the cells still to run is their cost at the seconds per FLOP measured on the finished
ones (training and evaluation apart; either one's rate while the other has none).
Before any cell has run, `calibrate` times a few training steps and forwards of one
cell's model on synthetic inputs on this machine: no data is read, and loading data,
decoding latents and the FID features are not counted.

A training run's seconds per step (`StepClock`, fed from its log.jsonl by `LogWatcher`),
with a one-line hint when its steps turn far slower than its first ones.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from uvic.config import Config, ModelConfig
from uvic.models.flops import forward_flops, training_flops

if TYPE_CHECKING:
    import torch

TRAIN, EVAL = "train", "eval"
YEAR = 365.25 * 86400  # seconds
# Model FLOPs of one timed step of a calibration: the config's batch per step, fewer images
# (at least one) where its step would cost more than this (about a second on 2 CPU cores).
PROBE_FLOPS = {"cpu": 7.5e10, "cuda": 5e13}
SLOW_FACTOR = 3.0  # recent steps this many times slower than the first ones: the hint


def duration(seconds: float) -> str:
    """A duration in words at a useful precision: `4.2 s`, `45 s`, `12.5 min`, `3.2 h`,
    `4.1 days`, `3.0 years` (a big model's training on a CPU)."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds < 2 * YEAR:
        return f"{seconds / 86400:.1f} days"
    return f"{seconds / YEAR:.1f} years"


def train_cost(cfg: Config, steps_done: int = 0) -> float:
    """Model FLOPs of training `cfg` from `steps_done` to train.max_steps."""
    left = max(0, cfg.train.max_steps - steps_done)
    return float(left * cfg.train.batch_size * training_flops(cfg.model))


def forward_cost(model: ModelConfig, images: int) -> float:
    """Model FLOPs of `images` forward passes of the network `model` (a sampler's network calls
    per image x images, the held-out MSE's images)."""
    return float(images * forward_flops(model))


def sampling_cost(cfg: Config, samples: int) -> float:
    """Model FLOPs of sampling `samples` images under the config's own protocol (its
    network passes per image, guidance included: `sampling_passes`)."""
    from uvic.diffusion.guidance_interval import sampling_passes

    return forward_cost(cfg.model, samples * sampling_passes(cfg))


@dataclass(frozen=True)
class Cell:
    """One unit of an experiment's work that is saved when done: its label, kind (`TRAIN`
    or `EVAL`) and cost in model FLOPs (what is left of it)."""

    label: str
    kind: str
    cost: float


@dataclass(frozen=True)
class Calibration:
    """Seconds per model FLOP measured on one cell's model, training and forward."""

    label: str  # the cell measured
    device: str  # where, e.g. "cpu (2 threads)"
    images: int  # per timed step
    step_s: float  # seconds per training step of `images` images
    train_s_per_flop: float
    forward_s_per_flop: float

    def rates(self) -> dict[str, float]:
        """Seconds per model FLOP by cell kind."""
        return {TRAIN: self.train_s_per_flop, EVAL: self.forward_s_per_flop}

    def text(self) -> str:
        """Where the times come from, in one line."""
        return (f"calibrated on {self.device}: a training step of {self.label} ({self.images} "
                f"images, synthetic) took {self.step_s:.3g} s, "
                f"{1e-9 / self.train_s_per_flop:.3g} GFLOP/s of model FLOPs, its sampling "
                f"forwards {1e-9 / self.forward_s_per_flop:.3g} GFLOP/s; every cell's time is "
                "its model FLOPs at these rates (network only: no data loading, latent "
                "decoding or FID features)")


@dataclass
class Clock:
    """The cells of an experiment, run `workers` at a time: what is done, what is left and
    when it ends at the rates measured so far (`rates`: seconds per FLOP by kind to start
    from, e.g. a calibration's; measured cells replace them)."""

    cells: list[Cell]
    workers: int = 1
    rates: dict[str, float] = field(default_factory=dict)
    now: Callable[[], float] = time.monotonic
    done: list[Cell] = field(default_factory=list)
    measured: dict[str, list[float]] = field(default_factory=dict)  # kind -> [s, FLOPs]
    timed: int = 0  # cells measured

    def __post_init__(self) -> None:
        self.start = self.now()

    def rate(self, kind: str) -> float | None:
        """Seconds per FLOP of `kind`: measured, else the other kind's, else the start's."""
        for k in (kind, EVAL if kind == TRAIN else TRAIN):
            seconds, flops = self.measured.get(k, (0.0, 0.0))
            if flops > 0:
                return seconds / flops
        return self.rates.get(kind)

    def left(self) -> list[Cell]:
        """The cells not done yet."""
        return [c for c in self.cells if c not in self.done]

    def eta(self) -> float | None:
        """Seconds until every cell is done (None: a kind with work left has no rate)."""
        total = 0.0
        for cell in self.left():
            if cell.cost > 0:
                rate = self.rate(cell.kind)
                if rate is None:
                    return None
                total += cell.cost * rate
        return total / max(1, self.workers)

    def finished(self, cell: Cell, seconds: float, worked: bool = True) -> str:
        """Record `cell` as done in `seconds` (`worked`: False when it was found done and
        skipped: no rate is measured on it); returns the progress line."""
        self.done.append(cell)
        if worked and cell.cost > 0:
            seconds_flops = self.measured.setdefault(cell.kind, [0.0, 0.0])
            seconds_flops[0] += seconds
            seconds_flops[1] += cell.cost
            self.timed += 1
        return self.line(cell, seconds, worked)

    def line(self, cell: Cell, seconds: float, worked: bool) -> str:
        """`progress: 3 of 8 cells done (last: ..., 4.2 min), 12.5 min so far; ETA ~25 min`."""
        how = duration(seconds) if worked else "found done"
        eta = self.eta()
        if not self.left():
            when = "all done"
        elif eta is None:
            when = "ETA after the first measured cell"
        else:
            source = (f"from {self.timed} measured cell{'s' * (self.timed != 1)}"
                      if self.timed else "calibrated")
            when = f"ETA ~{duration(eta)} ({source})"
        return (f"progress: {len(self.done)} of {len(self.cells)} cells done (last: "
                f"{cell.label}, {how}), {duration(self.now() - self.start)} so far; {when}")


def make_batch(model: ModelConfig, batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Random images (or latents) and, for conditional models, CLIP contexts or labels."""
    import torch

    m = model
    out = {"x": torch.randn(batch, m.in_chans, m.img_size, m.img_size, device=device)}
    if m.clip_dim > 0:
        out["context"] = torch.randn(batch, m.num_clip_token, m.clip_dim, device=device)
    if m.num_classes > 0:
        out["y"] = torch.randint(0, m.num_classes, (batch,), device=device)
    return out


def synthetic_loss(cfg: Config, model: torch.nn.Module, data: dict[str, torch.Tensor],
                   device: torch.device) -> Callable[[], torch.Tensor]:
    """The trainer's loss of `model` on the fixed batch `data` (zeros as the empty text
    context, the last class as the null class, its own noise generator): what a timed
    training step computes."""
    import torch

    from uvic.diffusion.schedule import Diffusion, diffusion_loss

    m, diffusion = cfg.model, Diffusion(cfg.diffusion)
    empty = (torch.zeros(m.num_clip_token, m.clip_dim, device=device) if m.clip_dim > 0
             else None)
    null_class = m.num_classes - 1 if m.num_classes > 0 else None
    generator = torch.Generator(device=device).manual_seed(0)
    return lambda: diffusion_loss(model, diffusion, data, generator, empty_context=empty,
                                  p_uncond=cfg.diffusion.p_uncond, null_class=null_class)


def probe_config(cfgs: Sequence[Config]) -> Config:
    """The config a calibration measures: the cheapest model per training image (the
    shortest probe); the others' times scale from it by their FLOPs."""
    return min(cfgs, key=lambda c: training_flops(c.model))


def calibrate(cfg: Config, label: str, threads: int | None = None,
              device: torch.device | str | None = None) -> Calibration:
    """Seconds per model FLOP of `cfg`'s training steps (forward, loss, backward, AdamW) and
    forwards, timed on synthetic inputs (its batch, or fewer images: `PROBE_FLOPS`).
    `threads`: torch's thread count while timing (a worker's share)."""
    import dataclasses

    import torch

    from uvic.models.uvit import build_model
    from uvic_kernels.fused_attention import interpreted_on_cpu

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    m = cfg.model
    if device.type == "cpu" and m.attention_backend == "auto" and interpreted_on_cpu():
        # the user's run would not go at the interpreter's pace
        m = dataclasses.replace(m, attention_backend="torch")
    per_image = training_flops(m)
    budget = PROBE_FLOPS.get(device.type, PROBE_FLOPS["cpu"])
    images = max(1, min(cfg.train.batch_size, int(budget // per_image)))
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.train.mixed_precision)
    precision = (torch.autocast(device.type, dtype=dtype) if dtype and device.type == "cuda"
                 else contextlib.nullcontext())
    try:
        torch.manual_seed(0)
        model = build_model(m).to(device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batch = make_batch(cfg.model, images, device)
        loss_of = synthetic_loss(cfg, model, batch, device)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            with precision:
                loss = loss_of()
            loss.backward()
            optimizer.step()

        t = torch.full((images,), 0.5, device=device)
        cond = {k: v for k, v in batch.items() if k != "x"}

        def forward() -> None:
            with torch.inference_mode(), precision:
                model(batch["x"], t, return_dict=False, **cond)

        step_s, forward_s = _timed(step, device), _timed(forward, device)
    finally:
        torch.set_num_threads(before)
    count = torch.get_num_threads() if threads is None else threads
    where = (f"{device.type} ({count} thread{'s' * (count != 1)})" if device.type == "cpu"
             else torch.cuda.get_device_name(device))
    return Calibration(label, where, images, step_s,
                       step_s / (images * training_flops(m)),
                       forward_s / (images * forward_flops(m)))


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    """Mean seconds of `fn` after one warm-up (CUDA-synchronised): one call where the
    warm-up took over a second, else three."""
    import torch

    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    repeats = 1 if time.perf_counter() - start > 1.0 else 3
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def estimate(cells: Sequence[Cell], rates: dict[str, float], workers: int = 1) -> float:
    """Seconds the `cells` take at `rates` (seconds per FLOP by kind), `workers` at once."""
    total = sum(c.cost * rates[c.kind] for c in cells)
    return total / max(1, workers) if math.isfinite(total) else math.inf


@dataclass
class StepClock:
    """Seconds per training step, fed (steps, seconds) windows: the first `steps` steps'
    average and the recent one's (at least the last `steps`); `add` returns a one-line hint,
    once, when the recent steps run over `factor` times slower than the first ones."""

    threads: int  # per process, named in the hint
    change: str = ""  # how to run fewer threads, in the hint ("": not said)
    factor: float = SLOW_FACTOR
    steps: int = 20
    first: float | None = None  # seconds per step of the first `steps` steps
    recent: deque[tuple[int, float]] = field(default_factory=deque)
    hinted: bool = False
    _start_steps: int = 0  # steps and seconds measured towards `first`
    _start_s: float = 0.0
    _after: int = 0  # steps measured after the first ones

    def add(self, steps: int, seconds: float) -> str | None:
        """Record a window of `steps` steps that took `seconds`; the hint line, or None."""
        if steps <= 0 or seconds <= 0:
            return None
        self.recent.append((steps, seconds))
        while sum(n for n, _ in self.recent) - self.recent[0][0] >= self.steps:
            self.recent.popleft()
        if self.first is None:
            self._start_steps += steps
            self._start_s += seconds
            if self._start_steps >= self.steps:
                self.first = self._start_s / self._start_steps
            return None
        self._after += steps
        now = self.per_step() or 0.0
        if self.hinted or self._after < self.steps or now <= self.factor * self.first:
            return None
        self.hinted = True
        fewer = f"; fewer threads may then run faster ({self.change})" if self.change else ""
        return (f"hint: steps now take {now:.3g} s, {now / self.first:.0f}x the "
                f"{self.first:.3g} s of the first ones, on {self.threads} "
                f"thread{'s' * (self.threads != 1)} per process: other work may share the "
                f"cores{fewer}")

    def per_step(self) -> float | None:
        """Mean seconds per step of the recent window (None before any)."""
        steps = sum(n for n, _ in self.recent)
        return sum(s for _, s in self.recent) / steps if steps else None

    def text(self) -> str:
        """`0.099 s/step` (recent average), or "" before any step."""
        now = self.per_step()
        return "" if now is None else f"{now:.3g} s/step"


class LogWatcher:
    """A run's log.jsonl read as the trainer appends to it: each record of this run (`since`:
    its `time` not earlier) after the first (its window holds the warm-up) adds its window
    to `clock` (seconds from its images/s and the global `batch`); the clock's hint goes to
    `say`. `poll` reads once; as a context manager a thread polls every `every` seconds."""

    def __init__(self, path: str | Path, clock: StepClock, batch: int,
                 say: Callable[[str], Any] = print, since: float | None = None,
                 every: float = 5.0) -> None:
        self.path, self.clock, self.batch, self.say = Path(path), clock, batch, say
        self.since = time.time() if since is None else since
        self.every = every
        self.last: dict | None = None  # the newest record of this run
        self._file: tuple[int, int] | None = None  # (device, inode) read
        self._offset, self._partial = 0, ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> list[dict]:
        """The records of this run written since the last poll (a log replaced by a fresh
        start is read from its beginning)."""
        try:
            stat = self.path.stat()
            if (stat.st_dev, stat.st_ino) != self._file or stat.st_size < self._offset:
                self._file, self._offset, self._partial = (stat.st_dev, stat.st_ino), 0, ""
            with open(self.path) as f:
                f.seek(self._offset)
                text = self._partial + f.read()
                self._offset = f.tell()
        except OSError:  # not written yet
            return []
        *lines, self._partial = text.split("\n")
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("time", 0) >= self.since:
                records.append(record)
                self._add(record)
        return records

    def _add(self, record: dict) -> None:
        last, self.last = self.last, record
        rate = record.get("images_per_s")
        if last is None or not rate or record.get("step", 0) <= last.get("step", 0):
            return
        steps = record["step"] - last["step"]
        if hint := self.clock.add(steps, steps * self.batch / rate):
            self.say(hint)

    def __enter__(self) -> LogWatcher:
        def run() -> None:
            while not self._stop.wait(self.every):
                with contextlib.suppress(ArithmeticError, LookupError, TypeError, ValueError):
                    self.poll()  # an odd record: no hint, and never a traceback mid-run

        self._thread = threading.Thread(target=run, name="log-watcher", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
