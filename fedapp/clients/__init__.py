"""Flower ``NumPyClient`` implementations, one module per algorithm family."""
