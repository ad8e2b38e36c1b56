"""The container backend runs the conformance kit every backend runs."""

from dsec_core.testing import BackendConformance


class TestContainerBackend(BackendConformance):
    backend_name = "container"
