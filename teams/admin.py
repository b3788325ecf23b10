from django.contrib import admin

from teams.actions import do_set_team_quota
from teams.models import ApiToken, Membership, Team


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ["name", "quota", "borrow_limit", "weight", "created_at"]
    inlines = [MembershipInline]

    def save_model(self, request, obj, form, change):
        # Quota changes go through the action so they are audited and wake the scheduler.
        if change and {"quota", "borrow_limit", "weight"} & set(form.changed_data):
            do_set_team_quota(
                obj,
                quota=obj.quota,
                borrow_limit=obj.borrow_limit,
                weight=obj.weight,
                actor=request.user,
            )
            return
        super().save_model(request, obj, form, change)


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "team", "role"]
    list_filter = ["team", "role"]


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ["name", "user", "prefix", "created_at", "expires_at", "revoked_at"]
    readonly_fields = ["digest", "prefix", "created_at", "last_used_at"]
