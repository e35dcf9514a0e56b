"""Reports of a diff: terminal table, JSON, CSV/parquet, self-contained HTML, JUnit XML."""
