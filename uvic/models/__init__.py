"""uvic.models."""
