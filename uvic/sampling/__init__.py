"""uvic.sampling.generate."""
