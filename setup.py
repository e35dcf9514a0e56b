"""Packages for setuptools; everything else is in pyproject.toml.

The bundled models live in the checkout's top-level ``reference_models/`` and install as
``layerdiff.reference_models``, so that an installed layerdiff claims no generic top-level
name in its users' environments (layerdiff/bundled.py resolves either name). pyproject.toml
cannot map one package into another's namespace beside an automatic package search.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["layerdiff", "layerdiff.*"]),
                "layerdiff.reference_models"],
      package_dir={"layerdiff.reference_models": "reference_models"},
      package_data={"layerdiff.reference_models": ["*.toml"]})
