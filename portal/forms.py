"""Portal forms; they reuse the API's field validation (jobs.validation)."""

import json
import shlex

from django import forms
from django.core.exceptions import ValidationError

from jobs import validation, whatif
from jobs.models import Job, Priority
from teams.models import Team


class JobForm(forms.Form):
    name = forms.CharField(max_length=100)
    team = forms.ModelChoiceField(queryset=Team.objects.none(), to_field_name="name")
    image = forms.CharField(
        max_length=255, initial="lockstep/trainer:latest", validators=[validation.validate_image]
    )
    image_pull_policy = forms.ChoiceField(
        choices=Job.PullPolicy.choices,
        initial=Job.PullPolicy.IF_NOT_PRESENT,
        label="Pull the image",
        required=False,  # an old saved spec or a script's POST without it: the default
        help_text="if-not-present: only when a node lacks it; always: every start (a moving tag).",
    )
    command = forms.CharField(
        max_length=4000,
        initial="python -m trainer --steps 300",
        help_text="Split into an argv list like a shell would, but never run through a shell.",
    )
    dataset = forms.CharField(
        max_length=1000,
        required=False,
        initial="synthetic://addition",
        validators=[validation.validate_dataset],
    )
    gpus = forms.IntegerField(min_value=1, initial=1, label="GPUs")
    min_gpus = forms.IntegerField(
        min_value=1,
        required=False,
        label="Min GPUs (elastic)",
        help_text="Empty: always all GPUs. Else, when the cluster is short the job may start or "
        "restart on fewer: a divisor of GPUs not below this (same global batch).",
    )
    priority = forms.ChoiceField(choices=Priority.choices, initial=Priority.NORMAL)
    max_restarts = forms.IntegerField(min_value=0, max_value=100, initial=3)
    checkpoint_interval_s = forms.IntegerField(
        min_value=10,
        required=False,
        label="Checkpoint interval (s)",
        help_text="Empty: Young/Daly's interval from the job's save cost and failure rate.",
    )
    time_limit_s = forms.IntegerField(min_value=1, required=False, label="Time limit (s)")
    layout = forms.ChoiceField(
        choices=Job.Layout.choices,
        initial=Job.Layout.AUTO,
        required=False,
        help_text="Reference trainer: auto picks data, tensor and pipeline parallelism for the "
        "GPUs each attempt gets; flags uses the command's --parallel/--tp/--pp.",
    )
    env = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text='JSON object, e.g. {"WANDB_MODE": "offline"}',
    )

    def __init__(self, *args, teams=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["team"].queryset = teams if teams is not None else Team.objects.none()

    def clean_image_pull_policy(self) -> str:
        return self.cleaned_data.get("image_pull_policy") or Job.PullPolicy.IF_NOT_PRESENT

    def clean_layout(self) -> str:
        return self.cleaned_data.get("layout") or Job.Layout.AUTO

    def clean_name(self):
        name = self.cleaned_data["name"].strip()
        if not name:
            raise ValidationError("Name must not be blank.")
        return name

    def clean_command(self):
        try:
            argv = shlex.split(self.cleaned_data["command"])
        except ValueError as exc:
            raise ValidationError(f"Could not split the command: {exc}.") from exc
        return validation.validate_command(argv)

    def clean_env(self):
        raw = self.cleaned_data.get("env", "").strip()
        if not raw:
            return {}
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValidationError(f"Not valid JSON: {exc.msg}.") from exc
        return validation.validate_env(value)

    def clean(self):
        data = super().clean()
        if data.get("gpus") and data.get("team"):
            try:
                validation.validate_gpus(data["gpus"], data["team"])
            except ValidationError as exc:
                self.add_error("gpus", exc)
        if data.get("gpus"):
            try:
                validation.validate_min_gpus(data.get("min_gpus"), data["gpus"])
            except ValidationError as exc:
                self.add_error("min_gpus", exc)
        if data.get("dataset") and data.get("team"):
            try:
                validation.validate_dataset_for_team(data["dataset"], data["team"])
            except ValidationError as exc:
                self.add_error("dataset", exc)
        return data


SPEC_FIELDS = tuple(name for name in JobForm.base_fields)


def job_spec(job) -> dict:
    """A job's fields as a spec a person can save and load into the submit form again."""
    return {
        "name": job.name,
        "team": job.team.name,
        "image": job.image,
        "image_pull_policy": job.image_pull_policy,
        "command": list(job.command),
        "dataset": job.dataset,
        "gpus": job.gpus,
        "min_gpus": job.min_gpus,
        "priority": job.priority,
        "max_restarts": job.max_restarts,
        "checkpoint_interval_s": job.checkpoint_interval_s,
        "time_limit_s": job.time_limit_s,
        "env": dict(job.env or {}),
        "layout": job.layout,
    }


def spec_as_form_data(spec: dict) -> dict:
    """A spec (the API's JSON shape: command a list, env an object) as JobForm input."""
    data = {}
    for name, value in spec.items():
        if value is None:
            value = ""
        elif name == "command" and isinstance(value, list):
            value = shlex.join(str(v) for v in value)
        elif name == "env" and isinstance(value, dict):
            value = json.dumps(value) if value else ""
        data[name] = value if isinstance(value, str) else json.dumps(value)
    return data


class JobSpecForm(forms.Form):
    """A saved job spec, uploaded as a file or pasted, in JSON or YAML, to prefill JobForm."""

    spec_file = forms.FileField(required=False, label="Spec file (.json, .yaml)")
    spec_text = forms.CharField(
        required=False,
        label="or paste a spec",
        widget=forms.Textarea(attrs={"rows": 4, "placeholder": '{"name": "run1", "gpus": 2}'}),
    )

    MAX_BYTES = 64 * 1024

    def clean(self):
        data = super().clean()
        upload, text = data.get("spec_file"), (data.get("spec_text") or "").strip()
        field = "spec_file" if upload else "spec_text"
        if upload:
            if upload.size > self.MAX_BYTES:
                self.add_error(field, f"The file is larger than {self.MAX_BYTES // 1024} KiB.")
                return data
            try:
                text = upload.read().decode("utf-8")
            except UnicodeDecodeError:
                self.add_error(field, "The file is not UTF-8 text.")
                return data
        if not text.strip():
            self.add_error("spec_text", "Choose a file or paste a spec.")
            return data
        try:
            spec = _parse_spec(text)
        except ValueError as exc:
            self.add_error(field, str(exc))
            return data
        unknown = sorted(set(spec) - set(SPEC_FIELDS))
        if unknown:
            self.add_error(
                field,
                f"Unknown field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}. "
                f"A spec has: {', '.join(SPEC_FIELDS)}.",
            )
            return data
        data["spec"] = spec
        return data


def _parse_spec(text: str) -> dict:
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as json_error:
        import yaml

        try:
            spec = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ValueError(
                f"Neither JSON ({json_error.msg}) nor YAML{where}: "
                f"{getattr(exc, 'problem', None) or exc}."
            ) from exc
    if not isinstance(spec, dict):
        raise ValueError('A spec is an object of job fields, e.g. {"name": "run1", "gpus": 2}.')
    return spec


class TeamQuotaForm(forms.ModelForm):
    class Meta:
        model = Team
        fields = ["quota", "borrow_limit", "weight", "isolated_only"]
        labels = {"isolated_only": "Isolated nodes only"}
        help_texts = {"isolated_only": "Never run this team's jobs on process-runtime nodes"}


class RegisterModelForm(forms.Form):
    name = forms.RegexField(
        regex=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
        max_length=100,
        error_messages={"invalid": "Use letters, digits, '.', '_' and '-'."},
    )
    notes = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))


class WhatIfForm(forms.Form):
    """A what-if: a window of recorded jobs, the cluster's GPU count, the quota promise's two
    scheduling settings, and per-team quota, borrow limit and weight, prefilled with today's
    values. Changes nothing when submitted."""

    since = forms.DateTimeField(
        label="From (UTC)",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M"),
    )
    until = forms.DateTimeField(
        label="To (UTC)",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M"),
    )
    gpus = forms.IntegerField(min_value=1, max_value=whatif.MAX_GPUS, label="Cluster GPUs")
    # The quota promise's settings (docs/scheduling.md, rule 1), prefilled with today's: an
    # unticked box is False, so each always says what the changed run uses.
    aged_borrowed_first = forms.BooleanField(
        required=False,
        label="Aged borrowed jobs before guaranteed work (AGED_BORROWED_FIRST)",
    )
    quota_before_drain = forms.BooleanField(
        required=False,
        label="Jobs within quota may start on a borrower's draining nodes (QUOTA_BEFORE_DRAIN)",
    )

    TEAM_FIELDS = ("quota", "borrow_limit", "weight")

    def __init__(self, *args, teams, cluster, now, **kwargs):
        since, until = whatif.default_window(now)
        initial = {"since": since, "until": until, "gpus": cluster.gpus or None}
        initial.update(whatif.current_policy())
        self.teams = list(teams)
        for team in self.teams:
            initial.update(
                {
                    f"team_{team.id}_quota": team.quota,
                    f"team_{team.id}_borrow_limit": team.borrow_limit,
                    f"team_{team.id}_weight": team.weight,
                }
            )
        initial.update(kwargs.pop("initial", {}))
        super().__init__(*args, initial=initial, **kwargs)
        for team in self.teams:
            # The same ranges as the team API's quota change (teams.api.TeamQuotaSerializer).
            self.fields[f"team_{team.id}_quota"] = forms.IntegerField(
                min_value=0, max_value=whatif.MAX_GPUS, label=f"{team.name} quota"
            )
            self.fields[f"team_{team.id}_borrow_limit"] = forms.IntegerField(
                min_value=0, max_value=whatif.MAX_GPUS, label=f"{team.name} borrow limit"
            )
            self.fields[f"team_{team.id}_weight"] = forms.FloatField(
                min_value=0.0, max_value=1000.0, label=f"{team.name} weight"
            )

    def team_rows(self):
        """(team, its bound fields in TEAM_FIELDS order) for the template."""
        return [(t, [self[f"team_{t.id}_{name}"] for name in self.TEAM_FIELDS]) for t in self.teams]

    def clean(self):
        data = super().clean()
        if self.errors:
            return data
        for name, message in whatif.check_request(since=data["since"], until=data["until"]).items():
            self.add_error(None if name == "__all__" else name, message)
        return data

    def policy(self) -> dict[str, bool]:
        return {key: self.cleaned_data[key] for key in whatif.POLICY_SETTINGS}

    def overrides(self) -> dict[str, dict]:
        """Per team name, the values given (the view compares them with today's)."""
        return {
            t.name: {name: self.cleaned_data[f"team_{t.id}_{name}"] for name in self.TEAM_FIELDS}
            for t in self.teams
        }
