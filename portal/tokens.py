"""The API tokens page (create, see once, revoke) and the sign-in view with failure throttling."""

from datetime import timedelta

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.views import LoginView
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from teams.actions import do_issue_token, do_revoke_token
from teams.models import ApiToken
from teams.throttle import client_address, record_failure, retry_after
from teams.tokens_api import MAX_EXPIRY_DAYS, token_name_error, token_state

EXPIRY_CHOICES = [("30", "30 days"), ("90", "90 days"), ("365", "1 year"), ("", "Never")]


class TokenForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="What it is for, e.g. 'sweep pipeline'.")
    expires_in_days = forms.TypedChoiceField(
        choices=EXPIRY_CHOICES,
        coerce=int,
        empty_value=None,
        required=False,
        initial="90",
        label="Expires after",
    )

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        self.user = user

    def clean_name(self) -> str:
        error = token_name_error(self.user, self.cleaned_data["name"])
        if error:
            raise forms.ValidationError(error)
        return self.cleaned_data["name"].strip()

    def clean_expires_in_days(self):
        days = self.cleaned_data["expires_in_days"]
        if days is not None and not 1 <= days <= MAX_EXPIRY_DAYS:
            raise forms.ValidationError(f"Choose 1 to {MAX_EXPIRY_DAYS} days, or never.")
        return days


@login_required
def tokens(request):
    """List my tokens; a POST creates one and shows its secret in this response only (it is
    never stored, so a reload cannot show it again)."""
    created = None
    if request.method == "POST":
        form = TokenForm(request.POST, user=request.user)
        if form.is_valid():
            days = form.cleaned_data["expires_in_days"]
            token, raw = do_issue_token(
                request.user,
                name=form.cleaned_data["name"],
                expires_at=timezone.now() + timedelta(days=days) if days else None,
            )
            created = {"token": token, "raw": raw}
            form = TokenForm(user=request.user)
    else:
        form = TokenForm(user=request.user)
    now = timezone.now()
    rows = [
        {"token": t, "state": token_state(t, now)}
        for t in ApiToken.objects.filter(user=request.user).order_by("-created_at", "-id")
    ]
    status = 400 if request.method == "POST" and created is None else 200
    return render(
        request,
        "tokens.html",
        {"form": form, "rows": rows, "created": created},
        status=status,
    )


@login_required
@require_POST
def revoke_token(request, token_id: int):
    # Only one's own tokens: anybody else's id is a 404, like one that does not exist.
    token = get_object_or_404(ApiToken, pk=token_id, user=request.user)
    if do_revoke_token(token, actor=request.user, now=timezone.now()):
        messages.info(request, f"Token {token.name!r} ({token.prefix}...) revoked.")
    return redirect("tokens")


class ThrottledLoginView(LoginView):
    """Django's sign-in, where every wrong password counts against the client's address and a
    blocked address is refused (429) without checking the password at all."""

    template_name = "login.html"

    def post(self, request, *args, **kwargs):
        wait = retry_after(client_address(request))
        if wait is not None:
            # An unbound form: a bound one would check the password while rendering.
            username = request.POST.get("username", "")
            form = self.get_form_class()(request, initial={"username": username})
            refusal = f"Too many failed sign-ins from your address; try again in {wait} s."
            context = self.get_context_data(form=form, refusal=refusal)
            response = self.render_to_response(context, status=429)
            response["Retry-After"] = str(wait)
            return response
        return super().post(request, *args, **kwargs)

    def form_invalid(self, form):
        record_failure(client_address(self.request))
        return super().form_invalid(form)
