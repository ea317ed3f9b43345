from setuptools import setup

# All settings live in pyproject.toml (nbdev 3); this shim is for tools that still look for setup.py.
setup()
