from django.core.management.base import BaseCommand

from jobs.scheduling.loop import run_forever


class Command(BaseCommand):
    help = "Run the scheduler loop (woken by events, plus a periodic tick)."

    def add_arguments(self, parser):
        parser.add_argument("--tick", type=float, default=None, help="seconds between passes")
        parser.add_argument("--once", action="store_true", help="run one pass and exit")

    def handle(self, tick=None, once=False, **options):
        run_forever(tick_s=tick, once=once)
