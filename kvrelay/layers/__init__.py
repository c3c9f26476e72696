"""Building blocks shared by the models."""
