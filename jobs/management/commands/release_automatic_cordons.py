"""`manage.py release_automatic_cordons NODE...`: uncordon the named nodes where the strikes
cordoned them automatically (an admin's cordon or drain stays), with an event saying who and
why. `lockstep up` runs it for its local demo nodes once their agents have registered: their
strikes come from its own earlier runs (an agent restarted with the platform), not from bad
hardware.

The last line of the output is JSON for scripts: per node name, its state, the reason of that
state, and whether it was released.
"""

import json

from django.core.management.base import BaseCommand

from jobs.actions import do_release_automatic_cordon
from jobs.models import Node


class Command(BaseCommand):
    help = "Uncordon the named nodes where strikes cordoned them automatically."

    def add_arguments(self, parser):
        parser.add_argument("nodes", nargs="+")
        parser.add_argument("--by", default="manage.py release_automatic_cordons")
        parser.add_argument("--reason", default="released by the operator's tool")

    def handle(self, nodes, by, reason, **options):
        report = {}
        for name in nodes:
            node = Node.objects.filter(name=name).first()
            if node is None:
                report[name] = {"state": None, "reason": "not registered", "released": False}
                continue
            released = do_release_automatic_cordon(node, by=by, reason=reason)
            node.refresh_from_db()
            report[name] = {
                "state": node.state,
                "reason": node.state_reason,
                "released": released,
            }
            if released:
                self.stdout.write(f"{name}: uncordoned (it was cordoned automatically)")
        self.stdout.write(json.dumps(report))
