"""Role ordering: each role can do everything the roles below it can."""

from tenancy.models import Membership

Role = Membership.Role

_RANK = {Role.VIEWER: 0, Role.DEVELOPER: 1, Role.ADMIN: 2, Role.OWNER: 3}


def role_at_least(role: str, minimum: str) -> bool:
    return _RANK[Role(role)] >= _RANK[Role(minimum)]
