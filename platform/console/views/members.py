"""Members of a tenant: invite by email (pending invitations listed, revocable), change roles, remove.

Membership is by invitation: an admin gives an address and the holder of the link accepts it (console/views/
invitation.py). The answer is the same whether the address has an account or not. Platform staff may also add an
existing user by username at once. Only an owner (or staff) grants, takes away or removes the owner role.
"""

from django.contrib import messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.shortcuts import get_object_or_404, redirect
from django.urls import reverse
from django.utils.html import format_html

from console.access import Role, actor_of, tenant_page
from console.forms import MemberAddForm, MemberRoleForm
from console.invitations import emails_reach_inboxes
from console.listing import listing
from console.pages import render_page
from console.views.post_only import post_only
from tenancy.invitations import invitation_create, invitation_revoke
from tenancy.selectors import invitations_of, invitations_pending_of, members_of
from tenancy.services import member_add, member_change_role, member_remove

SORTABLE = {
    "username": ("user__username",),
    "email": ("user__email", "user__username"),
    "role": ("role", "user__username"),
    "joined": ("created_at", "id"),
}


def _page(request, *, form=None, status=200):
    members = listing(request, members_of(tenant=request.seat.tenant), sortable=SORTABLE, default_sort="username")
    pending = invitations_pending_of(tenant=request.seat.tenant) if request.seat.can_manage_members else []
    context = {"members": members, "form": form or MemberAddForm(), "roles": Role.choices, "invitations": pending}
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
    if form.cleaned_data["username"]:
        return _add_existing(request, form)
    return _invite(request, form)


def _add_existing(request, form):
    """Staff only: member_add refuses a tenant's own admins (membership is by invitation)."""
    try:
        membership = member_add(actor=actor_of(request), tenant=request.seat.tenant, role=form.cleaned_data["role"],
                                username=form.cleaned_data["username"])  # fmt: skip
    except ValidationError as error:
        form.add_error(None, error)
        return _page(request, form=form, status=400)
    messages.success(request, f"Added {membership.user.get_username()} as {membership.role}.")
    return _back(request)


def _invite(request, form):
    email, role = form.cleaned_data["email"], form.cleaned_data["role"]
    try:
        _, api_link = invitation_create(actor=actor_of(request), tenant=request.seat.tenant, email=email, role=role)
    except ValidationError as error:
        form.add_error(None, error)
        return _page(request, form=form, status=400)
    if emails_reach_inboxes():
        messages.success(request, f"Invited {email} as {role}: they will get an email with a link to accept.")
    else:
        token = api_link.rstrip("/").rsplit("/", 1)[-1]
        link = request.build_absolute_uri(reverse("console:invitation", kwargs={"token": token}))
        messages.success(request, format_html(
            "Invited {} as {}. This server doesn't deliver email, so send them this link to accept: "
            '<code class="invite-link" data-testid="invite-link">{}</code>', email, role, link,
        ))  # fmt: skip
    return _back(request)


@post_only
@tenant_page(Role.ADMIN)
def invitation_revoke_view(request, invitation_id: int):
    invitation = get_object_or_404(invitations_of(tenant=request.seat.tenant), pk=invitation_id)
    try:
        invitation_revoke(actor=actor_of(request), invitation=invitation)
    except ValidationError as error:
        messages.error(request, " ".join(error.messages))
    else:
        messages.success(request, f"Revoked the invitation to {invitation.email}.")
    return _back(request)


def _membership(request, member_id: int):
    return get_object_or_404(members_of(tenant=request.seat.tenant), pk=member_id)


@post_only
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


@post_only
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
