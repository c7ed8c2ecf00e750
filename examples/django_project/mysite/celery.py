"""The project's Celery app: every setting comes from Django's settings with the ``CELERY_``
prefix, taskdedup's included (``CELERY_TASKDEDUP_URL`` is ``app.conf.taskdedup_url``).

Run a worker from the directory of ``manage.py``:  celery -A mysite worker -l INFO
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mysite.settings")

app = Celery("mysite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
