"""higgs_cli package."""
