"""Strategy library: one module per DP-FL algorithm family (math core + thin Flower glue)."""
