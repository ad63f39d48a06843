"""`celery -A workers.app worker ...`: the worker app, built from the settings when Celery's command
line imports this module. Nothing else imports it (producers use `workers.queue.app.create_app`)."""

from pipeline.settings import Settings
from workers.worker import build_worker_app

app = build_worker_app(Settings.load())
