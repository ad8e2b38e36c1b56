"""Catalogs: layer recipes, environments made of layers, and tasks with their rewards.

``model`` loads and checks catalog files, ``store`` is the node's registry of built catalogs,
``build`` builds a catalog's layers, ``rewards`` scores a task's run from native signals, and
``distribution`` publishes and pulls catalogs with their layers through a layer source.
"""

from .build import build_catalog
from .model import (REWARDS, Catalog, Environment, Task, catalog_schema, default_catalog_file,
                    load_catalog, parse_catalog)
from .rewards import compute_reward, junit_pass_rate
from .store import CatalogStore

__all__ = ["Catalog", "Environment", "Task", "CatalogStore", "load_catalog", "parse_catalog",
           "build_catalog", "catalog_schema", "default_catalog_file", "compute_reward",
           "junit_pass_rate", "REWARDS"]
