"""Audit entries in words: targets by their names ("Adapter support-bot", "support-bot v2", "Plan Pro") and
changed references by what they point at ("plan: Pro", not "plan: 2"), looked up once per page."""

from collections import defaultdict

from django.apps import apps

# target_type -> (model label, how to name one row)
TARGETS = {
    "Adapter": ("registry.Adapter", lambda row: f"Adapter {row.name}"),
    "AdapterVersion": ("registry.AdapterVersion", lambda row: f"{row.adapter.name} v{row.number}"),
    "BaseModel": ("registry.BaseModel", lambda row: f"Base model {row.name}"),
    "Plan": ("tenancy.Plan", lambda row: f"Plan {row.name}"),
    "Tenant": ("tenancy.Tenant", lambda row: f"Tenant {row.name}"),
    "Membership": ("tenancy.Membership", lambda row: f"Member {row.user.get_username()}"),
    "Engine": ("gateway.Engine", lambda row: f"Engine {row.name}"),
    "Invitation": ("tenancy.Invitation", lambda row: f"Invitation {row.email}"),
    "TrainingFile": ("finetuning.TrainingFile", lambda row: f"Training file {row.filename} · {row.public_id}"
                     + (" (deleted)" if row.deleted_at else "")),
    "FineTuningJob": ("finetuning.FineTuningJob", lambda row: f"Fine-tuning job {row.public_id}"),
}
RELATED = {"AdapterVersion": ["adapter"], "Membership": ["user"]}
# Fields of before/after that hold another row's id.
REFERENCES = {"plan": ("tenancy.Plan", "name"), "base_model_id": ("registry.BaseModel", "name")}


def _names(label: str, ids: set, describe) -> dict[str, str]:
    model = apps.get_model(label)
    rows = model.objects.filter(pk__in=[i for i in ids if str(i).isdigit()])
    related = RELATED.get(label.split(".")[1])
    if related:
        rows = rows.select_related(*related)
    return {str(row.pk): describe(row) for row in rows}


def _short(value) -> str:
    text = ", ".join(map(str, value)) if isinstance(value, list) else "" if value is None else str(value)
    return text if len(text) <= 40 else text[:39] + "…"


def describe_entries(entries) -> None:
    """Sets `target_text` and `change_rows` [(field, before, after)] on each entry of the page."""
    entries = list(entries)
    wanted: dict[str, set] = defaultdict(set)
    referenced: dict[str, set] = defaultdict(set)
    for entry in entries:
        if entry.target_type in TARGETS:
            wanted[entry.target_type].add(entry.target_id)
        for record in (entry.before or {}, entry.after or {}):
            for field in REFERENCES.keys() & record.keys():
                referenced[field].add(record[field])
    targets = {kind: _names(TARGETS[kind][0], ids, TARGETS[kind][1]) for kind, ids in wanted.items()}
    references = {
        field: {str(pk): str(name) for pk, name in apps.get_model(REFERENCES[field][0]).objects.filter(
            pk__in=[i for i in ids if str(i).isdigit()]).values_list("pk", REFERENCES[field][1])}
        for field, ids in referenced.items()
    }  # fmt: skip
    for entry in entries:
        entry.target_text = _target_text(entry, targets.get(entry.target_type, {}))
        entry.change_rows = _changes(entry, references)


def _target_text(entry, names: dict[str, str]) -> str:
    record = entry.after or entry.before or {}
    label = record.get("name") or record.get("user") or record.get("adapter") or record.get("email") or ""
    if entry.target_type == "ApiKey":
        return f"API key {entry.target_id.partition('.')[0]}" + (f" · {label}" if label else "")
    if entry.target_id in names:
        return names[entry.target_id]
    if entry.target_type == "AdapterVersion" and record.get("adapter"):
        return f"{record['adapter']} v{record.get('version', '')}".strip()
    kind = " ".join(part.lower() for part in _words(entry.target_type)).capitalize()
    return f"{kind} {label}" if label else f"{kind} (deleted)"


def _words(name: str) -> list[str]:
    words, current = [], ""
    for char in name:
        if char.isupper() and current:
            words.append(current)
            current = ""
        current += char
    return [*words, current] if current else words


def _changes(entry, references: dict[str, dict[str, str]]) -> list[tuple[str, str, str]]:
    before, after = entry.before or {}, entry.after or {}

    def shown(field: str, value) -> str:
        if field in references and value is not None:
            return references[field].get(str(value), _short(value))
        return _short(value)

    fields = [name for name in after if before.get(name) != after[name]] if after else list(before)
    return [
        (name.removesuffix("_id"), shown(name, before.get(name)), shown(name, after.get(name))) for name in fields[:6]
    ]
