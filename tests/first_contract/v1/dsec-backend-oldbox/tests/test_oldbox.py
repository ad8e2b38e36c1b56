"""The oldbox backend runs dsec's conformance kit (which dsec loads into every pytest run)."""

from dsec_core.testing.backend import BackendConformance


class TestOldbox(BackendConformance):
    backend_name = "oldbox"

    def test_hostname_names_the_sandbox(self, sandboxes):
        sb = sandboxes.create()
        assert sb.exec("hostname").stdout == f"dsec-{sb.id[:12]}\n".encode()
