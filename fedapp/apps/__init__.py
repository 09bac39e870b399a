"""The Flower apps (ServerApp, ClientApp) and the factories that build a run's strategy and clients."""
