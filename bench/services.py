"""Where the local services of scripts/services.sh answer (used by bench/stress_workers.py and by
the tests that drive them).

``SPECTUNE_PG_URL`` overrides the PostgreSQL URL; the default is the role and database
``spectune`` (password ``spectune``) that ``scripts/services.sh ensure`` creates on 127.0.0.1:5432.
"""

from __future__ import annotations

import os

PG_URL = os.environ.get("SPECTUNE_PG_URL",
                        "postgresql+psycopg://spectune:spectune@127.0.0.1:5432/spectune")
