from django.db import migrations, models
from django.db.migrations.operations import AddIndex


class AddIndexOnline(AddIndex):
    """CREATE INDEX CONCURRENTLY on PostgreSQL: a live cluster's allocation table can hold
    millions of rows, and a plain CREATE INDEX would block every claim while it builds.
    A plain index elsewhere (SQLite)."""

    atomic = False

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            if schema_editor.connection.vendor == "postgresql":
                schema_editor.add_index(model, self.index, concurrently=True)
            else:
                schema_editor.add_index(model, self.index)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            if schema_editor.connection.vendor == "postgresql":
                schema_editor.remove_index(model, self.index, concurrently=True)
            else:
                schema_editor.remove_index(model, self.index)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("jobs", "0021_layout"),
    ]

    operations = [
        AddIndexOnline(
            model_name="allocation",
            index=models.Index(fields=["released_at"], name="allocation_released_at"),
        ),
    ]
