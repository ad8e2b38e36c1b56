"""dsec core: hookspecs, records, errors, layers, node daemon and the conformance kit."""

__version__ = "0.1.0"
