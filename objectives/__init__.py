"""Pure loss functions over model outputs; train.py imports objectives.<config.objective>."""
