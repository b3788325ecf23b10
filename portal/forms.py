"""Portal forms; they reuse the API's field validation (jobs.validation)."""

import json
import shlex

from django import forms
from django.core.exceptions import ValidationError

from jobs import validation, whatif
from jobs.models import Priority
from teams.models import Team


class JobForm(forms.Form):
    name = forms.CharField(max_length=100)
    team = forms.ModelChoiceField(queryset=Team.objects.none(), to_field_name="name")
    image = forms.CharField(
        max_length=255, initial="lockstep/trainer:latest", validators=[validation.validate_image]
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
    priority = forms.ChoiceField(choices=Priority.choices, initial=Priority.NORMAL)
    max_restarts = forms.IntegerField(min_value=0, max_value=100, initial=3)
    time_limit_s = forms.IntegerField(min_value=1, required=False, label="Time limit (s)")
    env = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text='JSON object, e.g. {"WANDB_MODE": "offline"}',
    )

    def __init__(self, *args, teams=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["team"].queryset = teams if teams is not None else Team.objects.none()

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
        return data


class TeamQuotaForm(forms.ModelForm):
    class Meta:
        model = Team
        fields = ["quota", "borrow_limit", "weight"]


class RegisterModelForm(forms.Form):
    name = forms.RegexField(
        regex=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
        max_length=100,
        error_messages={"invalid": "Use letters, digits, '.', '_' and '-'."},
    )
    notes = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))


class WhatIfForm(forms.Form):
    """A what-if: a window of recorded jobs, the cluster's GPU count, and per-team quota,
    borrow limit and weight, prefilled with today's values. Changes nothing when submitted."""

    since = forms.DateTimeField(
        label="From (UTC)",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M"),
    )
    until = forms.DateTimeField(
        label="To (UTC)",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M"),
    )
    gpus = forms.IntegerField(min_value=1, max_value=whatif.MAX_GPUS, label="Cluster GPUs")

    TEAM_FIELDS = ("quota", "borrow_limit", "weight")

    def __init__(self, *args, teams, cluster, now, **kwargs):
        since, until = whatif.default_window(now)
        initial = {"since": since, "until": until, "gpus": cluster.gpus or None}
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

    def overrides(self) -> dict[str, dict]:
        """Per team name, the values given (the view compares them with today's)."""
        return {
            t.name: {name: self.cleaned_data[f"team_{t.id}_{name}"] for name in self.TEAM_FIELDS}
            for t in self.teams
        }
