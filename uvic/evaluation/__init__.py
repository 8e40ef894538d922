"""uvic.evaluation."""
