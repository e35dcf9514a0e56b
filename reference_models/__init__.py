"""Bundled cases: small real models with fixed-seed weights and generated data."""
