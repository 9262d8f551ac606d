"""Offline tasks built from the embedded corpus or a synthetic language (so fine-tuning runs
with no download), and the task metrics scored on the host."""
