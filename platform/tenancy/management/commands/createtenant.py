from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from tenancy.audit import Actor
from tenancy.models import Plan
from tenancy.services import tenant_create


class Command(BaseCommand):
    help = "Create a tenant on a plan."

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--name", default="")
        parser.add_argument("--plan", default="starter", help="plan slug (default: starter)")
        parser.add_argument("--billing-email", default="")

    def handle(self, *args, slug, name, plan, billing_email, **options):
        plan_obj = Plan.objects.filter(slug=plan).first()
        if plan_obj is None:
            raise CommandError(f"No plan {plan!r}. Plans: {', '.join(Plan.objects.values_list('slug', flat=True))}")
        try:
            tenant = tenant_create(
                actor=Actor.system(), slug=slug, name=name or slug, plan=plan_obj, billing_email=billing_email
            )
        except ValidationError as error:
            raise CommandError("; ".join(error.messages)) from error
        self.stdout.write(f"Created tenant {tenant.slug} on plan {plan_obj.slug}.")
