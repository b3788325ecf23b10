"""Portal forms; they reuse the API's field validation (jobs.validation)."""

import json
import shlex

from django import forms
from django.core.exceptions import ValidationError

from jobs import validation
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
