"""dpfl-flower: the Flower app (server/client apps, config, data, models, DP training, results)."""

__version__ = "0.1.0"
