"""`make demo MODEL=...`: the demo serves a vision-language checkpoint under its folder's name, and the image
example it prints runs unmodified (the openai package, a picture drawn with Pillow) through a gateway to that
engine, answering with the image's tokens among the prompt tokens."""

import re
import subprocess
import sys

import pytest
from django.core.management import CommandError

from console.management.commands.demo import chosen_model, examples
from tests.conftest import REPO
from tests.gateway.vlm.conftest import BASE_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.django_db]


def test_a_vision_language_checkpoint_is_served_under_its_folders_name(vision_stack, tmp_path):
    assert chosen_model(None, None) == (None, "quilt-demo", False)
    assert chosen_model(vision_stack.model_dir, None) == (vision_stack.model_dir, vision_stack.model_dir.name, True)
    assert chosen_model(vision_stack.model_dir, "reader")[1] == "reader"
    with pytest.raises(CommandError, match="no config.json"):
        chosen_model(tmp_path, None)


def test_the_printed_image_example_answers_through_the_gateway(vision_stack):
    printed = examples(base=vision_stack.gateway.removesuffix("/v1"), key=vision_stack.keys["main"], adapters=[],
                       model=BASE_MODEL, images=True)  # fmt: skip
    scripts = re.findall(r"<<'EOF'\n(.*?)\nEOF", printed, flags=re.S)
    assert len(scripts) == 2 and "image_url" in scripts[1]
    ran = subprocess.run([sys.executable, "-c", scripts[1]], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    usage = re.search(r"prompt_tokens=(\d+)", ran.stdout)
    assert usage and int(usage.group(1)) > 20  # the 224x160 picture alone takes 20 tokens at this model's sizes
