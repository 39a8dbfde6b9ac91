from django.db import migrations, models


def lineages(apps, schema_editor):
    """Each key's lineage: its own prefix, or that of the key it replaced (keys in creation order)."""
    ApiKey = apps.get_model("apikeys", "ApiKey")
    lineage_of: dict[str, str] = {}
    for key in ApiKey.objects.order_by("created", "pk"):
        key.lineage = lineage_of.get(key.pk) or key.lineage or key.prefix
        key.save(update_fields=["lineage"])
        if key.replaced_by_id is not None:
            lineage_of[key.replaced_by_id] = key.lineage


class Migration(migrations.Migration):
    dependencies = [("apikeys", "0003_apikey_own_limits")]

    operations = [
        migrations.AddField(
            model_name="apikey", name="lineage", field=models.CharField(blank=True, db_index=True, max_length=16)
        ),
        migrations.RunPython(lineages, migrations.RunPython.noop),
    ]
