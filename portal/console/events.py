"""The console's event log: every Event, filtered by kind, team, job, node and time, paged."""

from __future__ import annotations

from django import forms
from django.core.paginator import Paginator
from django.db.models import Q
from django.shortcuts import render

from jobs.models import (
    Event,
    Node,
)
from portal.console.access import Scope, console_view
from teams.models import Team

EVENTS_PER_PAGE = 50
_LOCAL = forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M")


class EventFilterForm(forms.Form):
    kind = forms.ChoiceField(required=False)
    team = forms.ModelChoiceField(
        queryset=Team.objects.none(), to_field_name="name", required=False, empty_label="any"
    )
    job = forms.IntegerField(required=False, min_value=1, label="Job id")
    node = forms.CharField(required=False, max_length=128)
    since = forms.DateTimeField(required=False, label="From (UTC)", widget=_LOCAL)
    until = forms.DateTimeField(required=False, label="To (UTC)", widget=_LOCAL)

    def __init__(self, *args, scope: Scope, **kwargs):
        super().__init__(*args, **kwargs)
        self.scope = scope
        self.fields["team"].queryset = scope.teams()
        kinds = scope.events().order_by("kind").values_list("kind", flat=True).distinct()
        self.fields["kind"].choices = [("", "any"), *((k, k) for k in kinds)]

    def clean_job(self):
        job_id = self.cleaned_data["job"]
        if job_id is not None and not self.scope.jobs().filter(pk=job_id).exists():
            raise forms.ValidationError("No such job in your teams.")
        return job_id

    def clean_node(self):
        name = self.cleaned_data["node"].strip()
        if name and not Node.objects.filter(name=name).exists():
            raise forms.ValidationError("No such node.")
        return name

    def clean(self):
        data = super().clean()
        since, until = data.get("since"), data.get("until")
        if since and until and since >= until:
            self.add_error("until", "Must be after the start.")
        return data

    def filter(self, events):
        data = self.cleaned_data
        if data.get("kind"):
            events = events.filter(kind=data["kind"])
        if data.get("team"):
            team = data["team"]
            events = events.filter(Q(team=team) | Q(job__team=team))
        if data.get("job"):
            events = events.filter(job_id=data["job"])
        if data.get("node"):
            events = events.filter(node__name=data["node"])
        if data.get("since"):
            events = events.filter(created_at__gte=data["since"])
        if data.get("until"):
            events = events.filter(created_at__lt=data["until"])
        return events


@console_view()
def events(request, scope):
    params = request.GET.copy()
    params.pop("page", None)
    form = EventFilterForm(params or None, scope=scope)
    status = 200
    if not params or form.is_valid():
        found = scope.events()
        if params:
            found = form.filter(found)
        found = found.select_related("job__team", "node", "team", "actor").order_by("-id")
    else:
        found, status = Event.objects.none(), 400
    page = Paginator(found, EVENTS_PER_PAGE).get_page(request.GET.get("page"))
    return render(
        request,
        "console_events.html",
        {
            "form": form,
            "page": page,
            "query": params.urlencode(),
            "scope": scope,
        },
        status=status,
    )
