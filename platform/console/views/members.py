"""Members of a tenant: add an existing user or invite one by email, change roles, remove.

Admins manage members; only an owner (or staff) grants, takes away or removes the owner role, as in the API.
"""

from django.contrib import messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.shortcuts import get_object_or_404, redirect
from django.utils.html import format_html
from django.views.decorators.http import require_POST

from console.access import Role, actor_of, tenant_page
from console.forms import MemberAddForm, MemberRoleForm
from console.invitations import emails_reach_inboxes, invitation_send
from console.listing import listing
from console.pages import render_page
from tenancy.selectors import members_of
from tenancy.services import member_add, member_change_role, member_remove

SORTABLE = {
    "username": ("user__username",),
    "email": ("user__email", "user__username"),
    "role": ("role", "user__username"),
    "joined": ("created_at", "id"),
}


def _page(request, *, form=None, status=200):
    members = listing(request, members_of(tenant=request.seat.tenant), sortable=SORTABLE, default_sort="username")
    context = {"members": members, "form": form or MemberAddForm(), "roles": Role.choices}
    return render_page(request, "console/members.html", context, section="members", status=status)


def _back(request):
    return redirect("console:members", slug=request.seat.tenant.slug)


def _check_owner_rule(request, *roles: str) -> None:
    if Role.OWNER in roles and not request.seat.is_owner:
        raise PermissionDenied("Only an owner can grant, take away or remove the owner role.")


@tenant_page(Role.VIEWER)
def members(request):
    if request.method != "POST":
        return _page(request)
    if not request.seat.can_manage_members:
        raise PermissionDenied("Managing members needs the admin role or higher.")
    form = MemberAddForm(request.POST)
    if not form.is_valid():
        return _page(request, form=form, status=400)
    _check_owner_rule(request, form.cleaned_data["role"])
    try:
        membership = member_add(actor=actor_of(request), tenant=request.seat.tenant, **form.cleaned_data)
    except ValidationError as error:
        form.add_error(None, error)
        return _page(request, form=form, status=400)
    user = membership.user
    if not user.has_usable_password() and user.email:
        link = invitation_send(request=request, user=user, tenant=request.seat.tenant)
        if emails_reach_inboxes():
            messages.success(request, f"Invited {user.email} as {membership.role}: they will get an email to set a password.")
        else:
            messages.success(request, format_html(
                "Invited {} as {}. This server doesn't deliver email, so send them this link to set a password: "
                '<code class="invite-link" data-testid="invite-link">{}</code>', user.email, membership.role, link,
            ))  # fmt: skip
    else:
        messages.success(request, f"Added {user.get_username()} as {membership.role}.")
    return _back(request)


def _membership(request, member_id: int):
    return get_object_or_404(members_of(tenant=request.seat.tenant), pk=member_id)


@require_POST
@tenant_page(Role.ADMIN)
def member_role(request, member_id: int):
    membership = _membership(request, member_id)
    form = MemberRoleForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Choose a role.")
        return _back(request)
    _check_owner_rule(request, membership.role, form.cleaned_data["role"])
    try:
        member_change_role(actor=actor_of(request), membership=membership, role=form.cleaned_data["role"])
    except ValidationError as error:
        messages.error(request, " ".join(error.messages))
    else:
        messages.success(request, f"{membership.user.get_username()} is now {form.cleaned_data['role']}.")
    return _back(request)


@require_POST
@tenant_page(Role.ADMIN)
def member_remove_view(request, member_id: int):
    membership = _membership(request, member_id)
    _check_owner_rule(request, membership.role)
    try:
        member_remove(actor=actor_of(request), membership=membership)
    except ValidationError as error:
        messages.error(request, " ".join(error.messages))
    else:
        messages.success(request, f"Removed {membership.user.get_username()} from {request.seat.tenant.name}.")
    return _back(request)
