"""ownmodel: a Flower app whose own model and data train with dpfl-flower's DP strategies and clients."""
