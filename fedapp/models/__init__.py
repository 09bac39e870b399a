"""The model zoo: torch-free names and facts (catalog) and the torch modules (zoo)."""
