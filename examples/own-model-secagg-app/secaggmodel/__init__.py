"""secaggmodel: a Flower app whose own model and data train with dpfl-flower's client-level DP under SecAgg+."""
