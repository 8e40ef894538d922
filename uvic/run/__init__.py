"""uvic.run."""
