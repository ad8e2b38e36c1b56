"""Catalogs: layer recipes, environments made of layers, and tasks with their rewards.

``model`` loads and checks catalog files, ``store`` is the node's registry of built catalogs,
``build`` builds a catalog's layers, ``rewards`` scores a task's run from native signals, and
``distribution`` publishes and pulls catalogs with their layers through a layer source.
"""

from .build import build_catalog
from .model import (
    REWARDS,
    Catalog,
    Environment,
    Task,
    catalog_schema,
    default_catalog_file,
    load_catalog,
    parse_catalog,
)
from .rewards import compute_reward, junit_pass_rate
from .store import CatalogStore

__all__ = [
    "REWARDS",
    "Catalog",
    "CatalogStore",
    "Environment",
    "Task",
    "build_catalog",
    "catalog_schema",
    "compute_reward",
    "default_catalog_file",
    "junit_pass_rate",
    "load_catalog",
    "parse_catalog",
]
