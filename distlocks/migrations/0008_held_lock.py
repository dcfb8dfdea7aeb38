from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("distlocks", "0007_native_lease_hot_updates"),
    ]

    operations = [
        migrations.CreateModel(
            name="HeldLock",
            fields=[],
            options={
                "verbose_name": "held lock",
                "verbose_name_plural": "held locks",
                "default_permissions": (),
                "proxy": True,
                "indexes": [],
                "constraints": [],
            },
            bases=("distlocks.lock",),
        ),
    ]
