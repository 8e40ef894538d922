"""uvic.diffusion.schedule."""
