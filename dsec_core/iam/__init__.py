"""IAM for the control plane: nested projects with quotas, API keys with roles (admin, member,
agent, builder) stored hashed, and the checks every apiserver request goes through.

``Iam.open(url)`` picks the store: SQLite by default (``$DSEC_HOME/iam.db``), etcd when several
apiservers share state. ``dsec iam ...`` manages it from the machine's shell, and every
apiserver serves it to keys under ``/v1/iam`` (``dsec_core.apiserver.iam_routes``).
"""

from __future__ import annotations

from .model import (
    LOOSEN_ROLES,
    MINTABLE,
    RESOURCES,
    ROLES,
    ROOT,
    KeyInfo,
    Principal,
    Project,
    ProjectRevocation,
    Quota,
    Usage,
    ancestors,
    check_key_name,
    check_project_path,
    in_subtree,
    parent_of,
)
from .service import (
    KEY_PREFIX,
    Iam,
    can_loosen,
    can_manage,
    can_reach,
    default_iam_url,
    mint_refusal,
)
from .store import EtcdStore, IamStore, SqliteStore

__all__ = [
    "KEY_PREFIX",
    "LOOSEN_ROLES",
    "MINTABLE",
    "RESOURCES",
    "ROLES",
    "ROOT",
    "EtcdStore",
    "Iam",
    "IamStore",
    "KeyInfo",
    "Principal",
    "Project",
    "ProjectRevocation",
    "Quota",
    "SqliteStore",
    "Usage",
    "ancestors",
    "can_loosen",
    "can_manage",
    "can_reach",
    "check_key_name",
    "check_project_path",
    "default_iam_url",
    "in_subtree",
    "mint_refusal",
    "parent_of",
]
