from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from registry.base_models import base_model_register
from tenancy.audit import Actor


class Command(BaseCommand):
    help = "Register a base checkpoint (a Hugging Face folder) under the name clients will use, or refresh it."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("checkpoint_dir")
        parser.add_argument("--max-context", type=int, default=None, help="Default: max_position_embeddings.")

    def handle(self, *args, name, checkpoint_dir, max_context, **options):
        try:
            model = base_model_register(
                actor=Actor.system(), name=name, checkpoint_dir=checkpoint_dir, max_context=max_context
            )
        except ValidationError as error:
            raise CommandError("; ".join(error.messages)) from None
        self.stdout.write(f"{model.name}: {model.architecture}, max context {model.max_context}, {model.checkpoint_dir}")
