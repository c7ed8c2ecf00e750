"""The project's ASGI entry point: Django, with taskdedup's dashboard mounted beside it.

    uvicorn mysite.asgi:application          # (pip install 'taskdedup[web]')

``/ops/taskdedup/`` is the read-only dashboard of the locks under ``mysite``'s prefix; every
other path is Django's. The dashboard has no login of its own: put this path behind your
authentication (a middleware, your reverse proxy) before exposing it.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mysite.settings")
django_application = get_asgi_application()  # sets Django up before settings are read

from django.conf import settings  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Mount  # noqa: E402

from taskdedup.web import create_app  # noqa: E402

# The dashboard answers only to the Host names Django answers to (a DNS-rebinding page
# cannot read it); loopback names are always accepted.
dashboard = create_app(
    settings.CELERY_TASKDEDUP_URL or settings.REDIS_URL, prefix=settings.CELERY_TASKDEDUP_PREFIX,
    allowed_hosts=[host for host in settings.ALLOWED_HOSTS if host != "*"],
)
application = Starlette(routes=[
    Mount("/ops/taskdedup", app=dashboard),
    Mount("/", app=django_application),
])
