from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from jobs.agent_api import AgentHeartbeatView, AgentLeavingView, AgentRegisterView
from jobs.api import JobViewSet, ModelVersionViewSet, NodeViewSet
from jobs.plan_api import PlanView
from jobs.preemption_api import PreemptionViewSet
from jobs.whatif_api import WhatIfViewSet
from portal import openapi, prometheus, tokens, views  # noqa: F401  (openapi: schema corrections)
from portal.console import events, nodes, preemptions, queue, reports, teams, whatif
from portal.static_views import plotly_js
from teams.api import TeamViewSet
from teams.tokens_api import TokenViewSet

router = DefaultRouter()
router.register("jobs", JobViewSet, basename="job")
router.register("models", ModelVersionViewSet, basename="modelversion")
router.register("nodes", NodeViewSet, basename="node")
router.register("teams", TeamViewSet, basename="team")
router.register("preemptions", PreemptionViewSet, basename="preemption")
router.register("whatif", WhatIfViewSet, basename="whatif")
router.register("tokens", TokenViewSet, basename="token")

urlpatterns = [
    path("", views.home, name="home"),
    path("login/", tokens.ThrottledLoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("jobs/new/", views.submit_job, name="submit"),
    path("jobs/<int:job_id>/", views.job_page, name="job"),
    path("jobs/<int:job_id>/cancel/", views.cancel_job, name="cancel"),
    path("jobs/<int:job_id>/spec/", views.job_spec_download, name="job_spec"),
    path("jobs/<int:job_id>/progress/", views.job_progress, name="job_progress"),
    path("checkpoints/<int:checkpoint_id>/register/", views.register_model, name="register"),
    path("models/", views.model_registry, name="models"),
    path("models/<int:version_id>/weights/", views.model_weights, name="model_weights"),
    path("cluster/", views.cluster, name="cluster"),
    path("tokens/", tokens.tokens, name="tokens"),
    path("tokens/<int:token_id>/revoke/", tokens.revoke_token, name="revoke_token"),
    path("console/teams/", teams.team_quotas, name="team_quotas"),
    path("console/preemptions/", preemptions.preemptions, name="preemptions"),
    path("console/queue/", queue.queue, name="console_queue"),
    path("console/nodes/", nodes.nodes, name="console_nodes"),
    path("console/reports/", reports.reports, name="console_reports"),
    path("console/events/", events.events, name="console_events"),
    path("console/whatif/", whatif.whatif_form, name="whatif"),
    path("console/whatif/<int:run_id>/", whatif.whatif_result, name="whatif_result"),
    path("vendor/plotly.min.js", plotly_js, name="plotly_js"),
    path("api/v1/agent/register/", AgentRegisterView.as_view(), name="agent-register"),
    path("api/v1/agent/heartbeat/", AgentHeartbeatView.as_view(), name="agent-heartbeat"),
    path("api/v1/agent/leaving/", AgentLeavingView.as_view(), name="agent-leaving"),
    path("api/v1/plan/", PlanView.as_view(), name="plan"),
    path("api/v1/", include(router.urls)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("metrics", prometheus.metrics_view, name="prometheus-metrics"),
    path("admin/", admin.site.urls),
]

# Unknown URLs and errors outside a view under /api/ answer JSON, like the API itself.
handler404 = "portal.api_errors.not_found"
handler500 = "portal.api_errors.server_error"
