from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from tenancy.selectors import tenants_for_user


@login_required
def overview(request):
    return render(request, "console/overview.html", {"tenants": tenants_for_user(user=request.user)})
