"""The page an invitation link opens: a logged-in person accepts into their account; anyone else logs in first
or makes a new account with the invited address. Accepting is tenancy.invitations.invitation_accept."""

from django import forms
from django.contrib import messages
from django.contrib.auth import login
from django.core.exceptions import ValidationError
from django.shortcuts import redirect, render

from tenancy.invitations import invitation_accept, invitation_pending


class NewAccountForm(forms.Form):
    username = forms.CharField(max_length=150)
    password = forms.CharField(widget=forms.PasswordInput, strip=False)


def invitation_accept_view(request, token: str):
    try:
        invitation = invitation_pending(token=token)
    except ValidationError as error:
        return render(request, "console/invitation.html", {"invalid": " ".join(error.messages)}, status=404)
    form = NewAccountForm(request.POST or None)
    context = {"invitation": invitation, "form": form}
    if request.method != "POST":
        return render(request, "console/invitation.html", context)
    if request.user.is_authenticated:
        fields = {"user": request.user}
    elif form.is_valid():
        fields = form.cleaned_data
    else:
        return render(request, "console/invitation.html", context, status=400)
    try:
        membership = invitation_accept(token=token, **fields)
    except ValidationError as error:
        form.add_error(None, error)
        return render(request, "console/invitation.html", context, status=400)
    if not request.user.is_authenticated:
        login(request, membership.user, backend="django.contrib.auth.backends.ModelBackend")
    messages.success(request, f"You joined {membership.tenant.name} as {membership.role}.")
    return redirect("console:tenant-overview", slug=membership.tenant.slug)
