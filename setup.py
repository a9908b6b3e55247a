"""Packaging metadata lives in setup.cfg; this file only installs the bundled models.

The repository keeps them in a top-level ``models/`` (the design's layout: F, graphs and a YAML config per
model); the package installs that folder as ``minicavs.models`` (with its YAML configs), so that
``minicavs train tree_lstm`` works from any directory after ``pip install .``. setup.cfg alone cannot map one
package to another folder while finding the others.
"""
from setuptools import find_packages, setup

setup(
    packages=find_packages(exclude=["tests", "tests.*", "tools", "tools.*", "models"]) + ["minicavs.models"],
    package_dir={"minicavs.models": "models"},
    package_data={"minicavs.models": ["*.yaml"]},
)
