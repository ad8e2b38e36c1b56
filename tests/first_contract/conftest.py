"""Plugins written for dsec's first plugin contract (``v1/``) and the same plugins migrated by
the docs' "Migrating a plugin written before this change" (docs/plugins/migrating.md) alone
(``v2/``), for tests/test_first_contract.py, which installs each as a third party would and
runs their own tests. They are packages, not tests of this suite: nothing here is collected."""

collect_ignore_glob = ["*"]
