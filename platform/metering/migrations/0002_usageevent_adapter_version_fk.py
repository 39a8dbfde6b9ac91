import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("metering", "0001_initial"),
        ("registry", "0001_initial"),
    ]

    operations = [
        migrations.RenameField(model_name="usageevent", old_name="adapter_version_id", new_name="adapter_version"),
        migrations.AlterField(
            model_name="usageevent",
            name="adapter_version",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="usage_events",
                to="registry.adapterversion",
            ),
        ),
    ]
