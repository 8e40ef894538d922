"""uvic.data.datasets."""
