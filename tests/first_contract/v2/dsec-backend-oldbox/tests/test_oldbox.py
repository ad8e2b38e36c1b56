"""The oldbox backend runs dsec's conformance kit (opted into by pyproject.toml)."""

from dsec_core.testing import BackendConformance


class TestOldbox(BackendConformance):
    backend_name = "oldbox"

    def test_hostname_names_the_sandbox(self, dsec_sandboxes):
        sb = dsec_sandboxes.create()
        assert sb.exec("hostname").stdout == f"dsec-{sb.id[:12]}\n".encode()
