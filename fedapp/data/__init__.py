"""Datasets as arrays, partitioners and a client's split of the training pool."""
