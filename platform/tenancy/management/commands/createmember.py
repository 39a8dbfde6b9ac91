from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from tenancy.audit import Actor
from tenancy.models import Membership, Tenant
from tenancy.services import member_add


class Command(BaseCommand):
    help = "Add a user to a tenant with a role, creating the user if --password or --email is given."

    def add_arguments(self, parser):
        parser.add_argument("tenant", help="tenant slug")
        parser.add_argument("username")
        parser.add_argument("--role", default=Membership.Role.DEVELOPER, choices=Membership.Role.values)
        parser.add_argument("--email", default="")
        parser.add_argument("--password", default="", help="creates the user with this password if new")

    def handle(self, *args, tenant, username, role, email, password, **options):
        tenant_obj = Tenant.objects.filter(slug=tenant).first()
        if tenant_obj is None:
            raise CommandError(f"No tenant {tenant!r}.")
        User = get_user_model()
        try:
            with transaction.atomic():
                if password and not User.objects.filter(username=username).exists():
                    User.objects.create_user(username=username, email=email, password=password)
                membership = member_add(
                    actor=Actor.system(), tenant=tenant_obj, role=role, username=username, email=email
                )
        except ValidationError as error:
            raise CommandError("; ".join(error.messages)) from error
        self.stdout.write(f"{membership.user.username} is now {membership.role} of {tenant_obj.slug}.")
