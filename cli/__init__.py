"""mlxspec's command line: one small module per command, each a thin wrapper over the API."""
