"""One file per architecture; train.py imports models.<config.model_name>."""
