"""diffusers pipelines of uvic's models (`UViTPipeline`) and their export from runs."""

from uvic.pipelines.pipeline_uvit import UViTPipeline

__all__ = ["UViTPipeline"]
