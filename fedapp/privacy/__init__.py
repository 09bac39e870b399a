"""The run's privacy setup shared by server and clients: per-client profiles, the client-level mechanism, SecAgg+."""
