"""Validation pairs: third-party reference models against ports written apart from layerdiff,
wired the way a new user would (a case file and a mapping, neither model edited)."""
