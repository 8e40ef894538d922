"""uvic.training."""
